"""Format, commit, corruption, retention, gc and the ckpt CLI on a local directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sailor.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    LocalStorage,
    NoCheckpointError,
    ParamState,
    ReshardError,
    TrainingGlobals,
    collect,
    committed_steps,
    latest_step,
    load,
    read_manifest,
    save_full,
    tp_slice,
    verify,
)
from sailor.checkpoint.checkpointer import Checkpointer
from sailor.checkpoint.cli import ckpt_app, inspect_text
from sailor.checkpoint.format import MARKER, step_dir
from sailor.checkpoint.gc import decide_prune
from sailor.checkpoint.prune import apply_seen_prune, seen_below
from sailor.checkpoint.writer import persist_layers
from tests.unit.test_checkpoint_blocks import one_layer_plan


def _state(seed: int = 0, layers: int = 4) -> dict[str, ParamState]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(layers):
        for name, shape, dim in [("w", (8, 4), 0), ("v", (4, 8), 1), ("b", (4,), None)]:
            ts = [torch.randn(*shape, generator=g) for _ in range(3)]
            out[f"{layer}.{name}"] = ParamState(*ts, tp_dim=dim)
    return out


def _save(root: Path, step: int, keep: int | None = None, seed: int = 0) -> None:
    save_full(
        LocalStorage(root),
        _state(seed),
        TrainingGlobals(step, step * 4, {"lr_step": step, "seeds": [1, 2]}),
        model="toy",
        num_layers=4,
        save_id=f"id{step}",
        keep=keep,
    )


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_reshard_to_any_tp(tmp_path: Path, tp: int) -> None:
    _save(tmp_path, 5)
    full = _state()
    for r in range(tp):
        got = load(LocalStorage(tmp_path), [1, 2], tp_rank=r, tp_size=tp)
        assert set(got.params) == {f"{x}.{n}" for x in (1, 2) for n in "wvb"}
        for k, p in got.params.items():
            for kind in ("weight", "exp_avg", "exp_avg_sq"):
                want = tp_slice(full[k].tensor(kind), full[k].tp_dim, r, tp)  # type: ignore[arg-type]
                assert torch.equal(p.tensor(kind), want), (k, kind)  # type: ignore[arg-type]
        assert got.bytes_read == 2 * sum(full[f"1.{n}"].nbytes for n in "wvb")


def test_reshard_refuses_indivisible_and_overrides_dim(tmp_path: Path) -> None:
    _save(tmp_path, 5)
    with pytest.raises(ReshardError, match="over tp=16"):
        load(LocalStorage(tmp_path), [0], tp_rank=0, tp_size=16)
    got = load(LocalStorage(tmp_path), [0], tp_rank=1, tp_size=2, tp_dims={"0.w": 1})
    assert torch.equal(got.params["0.w"].weight, _state()["0.w"].weight[:, 2:])


def test_uncommitted_is_invisible(tmp_path: Path) -> None:
    s = LocalStorage(tmp_path)
    with pytest.raises(NoCheckpointError):
        latest_step(s)
    _save(tmp_path, 1)
    by_layer = {0: {"w": _state()["0.w"]}}
    persist_layers(s, 2, "crashed", by_layer)  # shards and part, but no manifest or marker
    assert committed_steps(s) == [1]
    assert load(s, [0]).globals.step == 1
    with pytest.raises(NoCheckpointError):
        read_manifest(s, 2)


def test_bit_flip_named_by_verify_and_load(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    s = LocalStorage(tmp_path)
    shard = read_manifest(s, 3).shard_of(2)
    victim = shard.tensors[4]
    _flip_byte(tmp_path / step_dir(3) / shard.path, victim.offset + 3)
    problems = verify(s, 3)
    assert len(problems) == 1
    assert shard.path in problems[0] and victim.name in problems[0]
    with pytest.raises(CorruptCheckpointError) as err:
        load(s, [2], tp_rank=0, tp_size=2)
    assert err.value.path.endswith(shard.path) and not err.value.retryable
    assert load(s, [0, 1, 3]).globals.step == 3  # the other layers still load


def test_tampered_manifest_rejected(tmp_path: Path) -> None:
    _save(tmp_path, 3)
    m = tmp_path / step_dir(3) / "manifest.json"
    doc = json.loads(m.read_text())
    doc["consumed_samples"] += 1
    m.write_text(json.dumps(doc, indent=1))
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json"):
        load(LocalStorage(tmp_path), [0])
    assert "manifest.json" in verify(LocalStorage(tmp_path), 3)[0]


def test_a_step_directory_copied_under_another_step_is_refused(tmp_path: Path) -> None:
    """step-3 copied by hand to step-7: its state is step 3's. Before, it read as step 7's
    commit, and a resume from "step 7" started at step 3 (the manifest's position) while
    the controller waited past 7. Now it is refused by name, and nothing deletes it."""
    import shutil

    _save(tmp_path, 3)
    shutil.copytree(tmp_path / step_dir(3), tmp_path / step_dir(7))
    with pytest.raises(CorruptCheckpointError, match=r"holds step 3 .*not step 7") as info:
        read_manifest(LocalStorage(tmp_path), 7)
    assert not info.value.debris
    assert read_manifest(LocalStorage(tmp_path), 3).step == 3


@pytest.mark.parametrize(
    "value,want",
    [
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deep to read"),
        ("{not json", "not JSON"),
    ],
    ids=["nested-too-deep", "not-json"],
)
def test_a_manifests_global_that_does_not_parse_is_named(
    tmp_path: Path, value: str, want: str
) -> None:
    """A manifest (its commit marker's checksum matching) whose ``globals['seeds']`` is text
    nested past the parser's limit, or no JSON: the load and ``ckpt inspect`` name the file
    and the key (a ``CorruptCheckpointError``: the controller falls back to the previous
    commit) where ``json.loads`` raised a bare ``RecursionError`` / ``JSONDecodeError``."""
    import hashlib

    _save(tmp_path, 3)
    sd = tmp_path / step_dir(3)
    doc = json.loads((sd / "manifest.json").read_text())
    doc["globals"]["seeds"] = value
    raw = json.dumps(doc).encode()
    (sd / "manifest.json").write_bytes(raw)
    marker = json.loads((sd / MARKER).read_text())
    marker |= {"manifest_size": len(raw), "manifest_sha256": hashlib.sha256(raw).hexdigest()}
    (sd / MARKER).write_text(json.dumps(marker))
    where = f"{sd / 'manifest.json'}: globals['seeds']: {want}"
    with pytest.raises(CorruptCheckpointError) as info:
        load(LocalStorage(tmp_path), [0])
    assert str(info.value).startswith(where), info.value
    assert info.value.path == str(sd / "manifest.json") and not info.value.debris
    with pytest.raises(CorruptCheckpointError) as info:
        inspect_text(str(tmp_path))
    assert str(info.value).startswith(where), info.value
    res = CliRunner().invoke(ckpt_app, ["inspect", str(tmp_path)])
    unboxed = "".join(c for c in res.output if c not in "│ \n")  # the panel wraps lines
    assert res.exit_code == 1 and "globals['seeds']" in unboxed, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception


def test_retention_keeps_last_k_only_after_newer_commit(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=2)
    assert committed_steps(LocalStorage(tmp_path)) == [2, 3]
    # An uncommitted newer save does not count and is not touched by retention.
    persist_layers(LocalStorage(tmp_path), 9, "inflight", {0: {"w": _state()["0.w"]}})
    _save(tmp_path, 4, keep=2)
    assert committed_steps(LocalStorage(tmp_path)) == [3, 4]
    assert (tmp_path / step_dir(9)).is_dir()


def test_prune_below_deletes_older_steps_committed_or_not(tmp_path: Path) -> None:
    """The controller's retention: it names the oldest recorded step to keep; after the next
    commit every step directory below it goes, committed or not, newer ones never."""
    s = LocalStorage(tmp_path)
    for step in (1, 3, 5):
        _save(tmp_path, step)
    persist_layers(s, 2, "torn", {0: {"w": _state()["0.w"]}})  # a save that never committed
    persist_layers(s, 9, "inflight", {0: {"w": _state()["0.w"]}})  # newer: maybe running
    assert decide_prune([1, 2, 3, 5, 9], below_step=3, committed_step=5) == [
        f"{step_dir(1)}/",
        f"{step_dir(2)}/",
    ]
    with pytest.raises(ValueError, match="below_step=6: must be <= the step just committed"):
        decide_prune([1, 5], below_step=6, committed_step=5)
    seen = seen_below(s, 3)
    assert apply_seen_prune(s, seen, below_step=3, committed_step=5) == [
        f"{step_dir(1)}/",
        f"{step_dir(2)}/",
    ]
    assert committed_steps(s) == [3, 5] and (tmp_path / step_dir(9)).is_dir()
    assert verify(s, 3) == [] and verify(s, 5) == []
    assert apply_seen_prune(s, seen_below(s, 3), below_step=3, committed_step=5) == []


def test_checkpointer_prunes_after_its_commit_only(tmp_path: Path) -> None:
    """``Checkpointer.save(prune_below=)``: the committer deletes the older steps once its own
    checkpoint is committed; a prune point past the saved step is held at the saved step."""
    plan = one_layer_plan()
    state = _state(layers=1)
    s = LocalStorage(tmp_path)
    ck = Checkpointer(s, plan, 0, keep=None)
    for step in (1, 2, 3):
        ck.save(state, TrainingGlobals(step, step, {}))
        assert ck.wait() is not None
    assert committed_steps(s) == [1, 2, 3]
    ck.save(state, TrainingGlobals(4, 4, {}), prune_below=3)
    res = ck.wait()
    assert res is not None and res.retention_error == "" and res.manifest is not None
    assert committed_steps(s) == [3, 4]
    ck.save(state, TrainingGlobals(5, 5, {}), prune_below=99)  # held at 5: 5 itself stays
    ck.wait()
    ck.close()
    assert committed_steps(s) == [5]
    assert verify(s, 5) == []


def test_gc_collects_debris_and_spares_running_saves(tmp_path: Path) -> None:
    _save(tmp_path, 4)
    s = LocalStorage(tmp_path)
    # below the newest commit and still running: a run that fell back below a commit the
    # controller never recorded saves there (an operator's gc swept it and its commit went
    # through with the shards gone)
    persist_layers(s, 2, "fallback", {0: {"w": _state()["0.w"]}})
    persist_layers(s, 6, "new", {0: {"w": _state()["0.w"]}})  # maybe still running
    (tmp_path / step_dir(4) / ".layer-00000-x.bin.tmp-dead").write_bytes(b"torn")
    (tmp_path / step_dir(4) / "layer-00000-crashed.bin").write_bytes(b"earlier attempt")
    assert collect(s, grace_s=3600) == []
    assert (tmp_path / step_dir(2)).is_dir() and (tmp_path / step_dir(6)).is_dir()
    doomed = collect(s, grace_s=0)
    assert f"{step_dir(2)}/" in doomed and f"{step_dir(6)}/" in doomed
    assert f"{step_dir(4)}/layer-00000-crashed.bin" in doomed
    assert f"{step_dir(4)}/.layer-00000-x.bin.tmp-dead" in doomed
    assert [p.name for p in tmp_path.iterdir()] == [step_dir(4)]
    assert verify(s, 4) == []
    assert collect(s) == []


def test_exact_adamw_resume(tmp_path: Path) -> None:
    """Saving weights + both moments + step loses nothing: N+M steps == N, reload, M."""

    def model() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    data = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 6, generator=data) for _ in range(10)]
    ys = [torch.randn(5, 1, generator=data) for _ in range(10)]

    def train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
        losses = []
        for i in steps:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(xs[i]), ys[i])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    # Global layers: Linear 0 -> layer 0, Linear 2 -> layer 1 (the Tanh holds no state).
    keys = {"0.weight": "0.fc.weight", "0.bias": "0.fc.bias"}
    keys |= {"2.weight": "1.fc.weight", "2.bias": "1.fc.bias"}
    ref_m = model()
    ref_opt = torch.optim.AdamW(ref_m.parameters(), lr=0.05)
    ref = train(ref_m, ref_opt, range(10))

    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    first = train(m, opt, range(6))
    named = dict(m.named_parameters())
    st = {
        keys[n]: ParamState(p.data, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
        for n, p in named.items()
    }
    save_full(
        LocalStorage(tmp_path),
        st,
        TrainingGlobals(6, 30, {"adam_step": 6}),
        model="toy",
        num_layers=2,
    )

    m2 = model()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.05)
    got = load(LocalStorage(tmp_path), [0, 1])
    for n, p in m2.named_parameters():
        ps = got.params[keys[n]]
        p.data.copy_(ps.weight)
        opt2.state[p] = {
            "step": torch.tensor(float(got.globals.extra["adam_step"])),
            "exp_avg": ps.exp_avg.clone(),
            "exp_avg_sq": ps.exp_avg_sq.clone(),
        }
    rest = train(m2, opt2, range(6, 10))
    assert first + rest == ref  # bitwise: fp32, same ops in the same order
    for (_, a), (_, b) in zip(ref_m.named_parameters(), m2.named_parameters(), strict=True):
        assert torch.equal(a, b)


def test_cli_ls_inspect_verify_gc(tmp_path: Path) -> None:
    runner = CliRunner()
    _save(tmp_path, 7)
    res = runner.invoke(ckpt_app, ["ls", str(tmp_path)])
    assert res.exit_code == 0 and " 7 " in res.output and "ok" in res.output
    res = runner.invoke(ckpt_app, ["inspect", str(tmp_path), "--tensors"])
    assert res.exit_code == 0
    assert "step 7  consumed_samples 28" in res.output and "3.v.exp_avg_sq" in res.output
    assert '"lr_step": 7' in res.output
    assert runner.invoke(ckpt_app, ["verify", str(tmp_path)]).exit_code == 0
    shard = read_manifest(LocalStorage(tmp_path), 7).shard_of(1).path
    p = tmp_path / step_dir(7) / shard
    p.write_bytes(p.read_bytes()[:-1])
    res = runner.invoke(ckpt_app, ["verify", str(tmp_path)])
    assert res.exit_code == 1 and shard in res.output and "CORRUPT" in res.output
    (tmp_path / step_dir(8)).mkdir()
    (tmp_path / step_dir(8) / "layer-00000-z.bin").write_bytes(b"x")
    # by default a save touched within the hour is spared: it may be running on a live root
    res = runner.invoke(ckpt_app, ["gc", str(tmp_path)])
    assert res.exit_code == 0 and "deleted 0 path(s)" in res.output
    res = runner.invoke(ckpt_app, ["gc", str(tmp_path), "--grace", "0", "--dry-run"])
    assert "would delete step-000000008/" in res.output
    assert (tmp_path / step_dir(8)).exists()
    res = runner.invoke(ckpt_app, ["gc", str(tmp_path), "--grace", "0"])
    assert res.exit_code == 0 and not (tmp_path / step_dir(8)).exists()
    assert (tmp_path / step_dir(7) / MARKER).exists()
    res = runner.invoke(ckpt_app, ["inspect", str(tmp_path / "empty")])
    assert res.exit_code == 1 and "no committed checkpoint" in res.output
    # nothing to verify is not "verified": a wrong root fails the command
    res = runner.invoke(ckpt_app, ["verify", str(tmp_path / "empty")])
    assert res.exit_code == 1 and "no committed checkpoint" in res.output


def test_commit_checks_its_shards_and_uncommits_before_a_new_manifest(tmp_path: Path) -> None:
    """A shard gone between its write and the commit (a gc, a crash) stops the commit: the
    marker never stands over missing files. A step committed before (an attempt nobody
    recorded) loses its marker before its manifest is replaced, so a crash in between leaves
    it uncommitted, not an old marker over a new manifest."""
    from sailor.checkpoint.writer import commit

    s = LocalStorage(tmp_path)
    g = TrainingGlobals(3, 12, {"lr_step": 3})
    state = _state()
    by_layer: dict[int, dict[str, ParamState]] = {}
    for key, p in state.items():
        layer, name = key.split(".")
        by_layer.setdefault(int(layer), {})[name] = p
    persist_layers(s, 3, "a", by_layer, rank=0)
    shard = next((tmp_path / step_dir(3)).glob("layer-*"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} is missing"):
        commit(s, step=3, save_id="a", writer_ranks=[0], globals_=g, model="toy", num_layers=4)
    assert committed_steps(s) == []
    _save(tmp_path, 3)  # a complete save of the same step commits
    assert committed_steps(s) == [3] and verify(s, 3) == []

    def crash() -> None:
        raise KeyboardInterrupt  # the committer dies between manifest and marker

    persist_layers(s, 3, "b", by_layer, rank=0)
    with pytest.raises(KeyboardInterrupt):
        commit(
            s,
            step=3,
            save_id="b",
            writer_ranks=[0],
            globals_=g,
            model="toy",
            num_layers=4,
            before_marker=crash,
        )
    assert committed_steps(s) == [] and not (tmp_path / step_dir(3) / MARKER).exists()
