"""The engine's stages of ``transformers`` models against ``transformers`` itself (one process).

Per family: the whole model as one engine stage, with the weights of a random
``transformers`` model converted to layer-keyed names, gives the same loss and gradients
(fp32); importing a saved directory into uneven stages at TP 1/2/4 reads exactly the full
tensors sliced; export gives a directory ``from_pretrained`` loads into the same model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sailor.megatron_patch.hf.checkpoint import export, load_config, load_model, read_layers
from sailor.megatron_patch.hf.config import UnsupportedConfigError, from_hf_config
from sailor.megatron_patch.hf.convert import canonical_name, engine_to_hf, hf_to_engine
from sailor.megatron_patch.model import GPTStage, shard
from sailor.megatron_patch.state import load_full_state
from sailor.megatron_patch.tp_layers import TPContext, tp_dim_of
from tests.hf_models import SEQ, VOCAB, lm_loss, save_tiny, tiny_config, tiny_model

FAMILIES = ["gpt2", "opt", "gpt_neox", "llama"]


def _engine(family: str, model: object) -> GPTStage:
    spec, arch = from_hf_config(tiny_config(family), SEQ, 4)
    stage = GPTStage(spec, 0, spec.num_all_layers - 1, arch=arch, tie_in_module=True)
    load_full_state(stage, hf_to_engine(spec, arch, model.state_dict()))  # type: ignore[attr-defined]
    return stage


@pytest.mark.parametrize("family", [*FAMILIES, "opt-prenorm"])
def test_loss_and_gradients_equal_transformers(family: str) -> None:
    model = tiny_model(family)
    stage = _engine(family, model)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    ref = lm_loss(model, x, y)
    loss = stage(x, y)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    ref.backward()
    loss.backward()
    spec, arch = stage.spec, stage.arch
    mine = engine_to_hf(spec, arch, {n: p.grad for n, p in stage.keyed_parameters()})
    theirs = {canonical_name(arch, n): p.grad for n, p in model.named_parameters()}
    assert set(theirs) <= {canonical_name(arch, n) for n in mine}
    total = sum(float(g.norm()) ** 2 for g in theirs.values()) ** 0.5
    for name, grad in theirs.items():
        # relative to the tensor's norm, plus 1e-6 of the whole gradient's: some gradients
        # are exactly 0 in exact arithmetic (the key bias: softmax is shift-invariant) and
        # only rounding remains of them.
        err = float((mine[name] - grad).norm())
        assert err <= 1e-5 * float(grad.norm()) + 1e-6 * total, (name, err, float(grad.norm()))


def _tp(size: int, rank: int) -> TPContext:
    return TPContext(size=size, rank=rank, group=object())


def _saved(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a saved tiny model's ``model.safetensors``."""
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _resave(model_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` over the directory's ``model.safetensors``."""
    from safetensors.torch import save_file

    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def _refused_and_unchanged(
    stage: GPTStage, model_dir: Path, error: type[Exception], match: str
) -> None:
    """``load_stage`` refuses the directory and leaves every parameter as it was."""
    from sailor.megatron_patch.hf.checkpoint import load_stage

    before = {n: p.detach().clone() for n, p in stage.keyed_parameters()}
    with pytest.raises(error, match=match):
        load_stage(stage, model_dir)
    for n, p in stage.keyed_parameters():
        assert torch.equal(p.detach(), before[n]), n


@pytest.mark.parametrize("family", FAMILIES)
def test_import_into_uneven_stages_at_any_tp_and_export_back(family: str, tmp_path: Path) -> None:
    model = save_tiny(family, tmp_path / "in")
    spec, arch = load_model(tmp_path / "in", SEQ, 4)
    full = hf_to_engine(spec, arch, model.state_dict())
    layers = spec.num_all_layers  # 6: embedding, 4 blocks, head
    gathered: dict[str, torch.Tensor] = {}
    for first, last, tp in ((0, 0, 1), (1, 3, 2), (4, 5, 2), (0, 2, 1), (3, 5, 1)):
        if family == "llama" and tp > 2:  # 2 KV heads
            continue
        part = read_layers(tmp_path / "in", spec, arch, range(first, last + 1))
        for rank in range(tp):
            stage = GPTStage(spec, first, last, tp=_tp(tp, rank), arch=arch)
            load_full_state(stage, part)
            for name, p in stage.keyed_parameters():
                want = shard(full[name], tp_dim_of(p), tp, rank)
                assert torch.equal(p.detach(), want), (first, last, tp, rank, name)
        gathered.update(part)
    assert set(gathered) == set(full)
    assert layers == 6

    out = export(gathered, spec, arch, load_config(tmp_path / "in"), tmp_path / "out")
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=x).logits, model(input_ids=x).logits)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], t, rtol=0, atol=0, msg=name)


def test_a_config_the_engine_cannot_reproduce_is_refused_by_name() -> None:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    with pytest.raises(UnsupportedConfigError, match="rope_parameters"):
        from_hf_config(cfg, 16)
    gpt2 = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, scale_attn_by_inverse_layer_idx=True
    )
    with pytest.raises(UnsupportedConfigError, match="scale_attn_by_inverse_layer_idx=True"):
        from_hf_config(gpt2, 16)
    with pytest.raises(UnsupportedConfigError, match="model_type"):
        from_hf_config(transformers.BertConfig(), 16)


def test_llama_with_mlp_biases_keeps_every_bias() -> None:
    """HF Llama's ``mlp_bias`` puts a bias on gate_proj too; the engine dropped that one
    (built without it) and the loss differed. Biases are random here (HF starts them at 0,
    which would hide it)."""
    model = tiny_model("llama-mlp-bias")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    stage = _engine("llama-mlp-bias", model)
    assert any(n.endswith("mlp_gate.bias") for n, _ in stage.keyed_parameters())
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    torch.testing.assert_close(stage(x, y), lm_loss(model, x, y), rtol=1e-6, atol=1e-6)


def test_published_opt_names_without_the_model_prefix_load(tmp_path: Path) -> None:
    """facebook/opt-* weights were saved from OPTModel: ``decoder.…``, not
    ``model.decoder.…``; they load as the prefixed names do."""
    from sailor.megatron_patch.hf.checkpoint import load_stage

    save_tiny("opt", tmp_path)
    bare = {n.removeprefix("model."): t for n, t in _saved(tmp_path).items()}
    assert any(n.startswith("decoder.") for n in bare)
    _resave(tmp_path, bare)
    spec, arch = load_model(tmp_path, SEQ, 4)
    stage = GPTStage(spec, 0, spec.num_all_layers - 1, arch=arch)
    load_stage(stage, tmp_path)  # raised KeyError on model.decoder.layers.0...
    full = read_layers(tmp_path, spec, arch, range(spec.num_all_layers))
    for n, p in stage.keyed_parameters():
        torch.testing.assert_close(p.detach(), full[n])


def test_a_checkpoint_model_trains_mixed_on_gpus_and_fp32_on_cpus(tmp_path: Path) -> None:
    """A model read from a checkpoint asked for fp32, so it trained in full precision on
    GPUs; it now asks for mixed precision, which the plan's devices resolve."""
    from sailor import catalog
    from sailor.schemas.precision import choose_precision

    save_tiny("llama", tmp_path)
    spec, _ = load_model(tmp_path, SEQ, 4)
    assert spec.precision != "fp32"
    assert choose_precision(["A100-40"], catalog.gpus(), spec.precision) == "bf16"
    assert choose_precision(["V100-16"], catalog.gpus(), spec.precision) == "fp16"
    assert choose_precision(["cpu"], catalog.gpus(), spec.precision) == "fp32"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_load_stage_reads_one_layer_at_a_time_in_the_files_dtype(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank holds one layer's full tensors at a time, in the checkpoint's dtype (bf16
    here), never its whole stage in fp32; the shards it loads are those of the fp32 import
    (a bf16 value is exact in fp32). gpt2 ties its head to the embedding: the head's layer
    brings the embedding along."""
    import sailor.megatron_patch.hf.checkpoint as ckpt

    save_tiny(family, tmp_path)
    _resave(tmp_path, {n: t.to(torch.bfloat16) for n, t in _saved(tmp_path).items()})
    spec, arch = load_model(tmp_path, SEQ, 4)
    reads: list[tuple[list[int], set[torch.dtype]]] = []
    real = ckpt._read

    def spy(index, spec_, arch_, layers, dtype, *, meta=False):  # type: ignore[no-untyped-def]
        out = real(index, spec_, arch_, layers, dtype, meta=meta)
        if not meta:
            reads.append((list(layers), {t.dtype for t in out.values()}))
        return out

    monkeypatch.setattr(ckpt, "_read", spy)
    last = spec.num_all_layers - 1
    for first, end, tp in ((0, 2, 2), (3, last, 2), (0, last, 1)):
        reads.clear()
        full = read_layers(tmp_path, spec, arch, range(first, end + 1))
        reads.clear()
        for rank in range(tp):
            stage = GPTStage(spec, first, end, tp=_tp(tp, rank), arch=arch)
            ckpt.load_stage(stage, tmp_path)
            for name, p in stage.keyed_parameters():
                assert p.dtype == torch.float32
                assert torch.equal(p.detach(), shard(full[name], tp_dim_of(p), tp, rank)), name
        assert [r[0] for r in reads] == [[layer] for layer in range(first, end + 1)] * tp
        assert all(r[1] == {torch.bfloat16} for r in reads)


def test_load_stage_refuses_a_mismatched_checkpoint_before_loading(tmp_path: Path) -> None:
    """Missing and extra weights are found from the files' headers, before any layer is
    read: the stage is left as it was."""
    save_tiny("llama", tmp_path)
    state = _saved(tmp_path)
    spec, arch = load_model(tmp_path, SEQ, 4)
    gone = next(n for n in state if n.endswith("layers.1.mlp.up_proj.weight"))
    _resave(tmp_path, {n: t for n, t in state.items() if n != gone})
    stage = GPTStage(spec, 0, spec.num_all_layers - 1, arch=arch)
    _refused_and_unchanged(stage, tmp_path, KeyError, "no weights for")
    extra = dict(state)
    extra["model.layers.0.mlp.up_proj.bias"] = torch.zeros(state[gone].shape[0])
    _resave(tmp_path, extra)
    _refused_and_unchanged(stage, tmp_path, KeyError, "no parameter in the engine's model")


@pytest.mark.parametrize(
    "weight,shape",
    [("layers.3.mlp.up_proj.weight", "one row short"), ("layers.0.input_layernorm.weight", "[1]")],
)
def test_load_stage_refuses_weights_of_another_shape_before_loading(
    weight: str, shape: str, tmp_path: Path
) -> None:
    """A weight of another shape is refused from the headers, before anything is loaded: a
    copy would fail half-way (a row short) or broadcast silently (a [1] norm weight)."""
    save_tiny("llama", tmp_path)
    state = _saved(tmp_path)
    name = next(n for n in state if n.endswith(weight))
    state[name] = state[name][:-1] if shape == "one row short" else torch.full((1,), 7.0)
    _resave(tmp_path, state)
    spec, arch = load_model(tmp_path, SEQ, 4)
    stage = GPTStage(spec, 0, spec.num_all_layers - 1, arch=arch)
    _refused_and_unchanged(stage, tmp_path, ValueError, "another shape")


def test_an_untied_head_without_its_weight_takes_the_embedding_per_layer(tmp_path: Path) -> None:
    """A checkpoint that leaves out an untied head's weight gives the head the embedding's
    (as converting the whole state dict does); reading the head's layer alone brings the
    embedding along."""
    from sailor.megatron_patch.hf.checkpoint import load_stage

    model = save_tiny("llama", tmp_path)
    spec, arch = load_model(tmp_path, SEQ, 4)
    assert not spec.tie_embeddings
    state = _saved(tmp_path)
    del state["lm_head.weight"]
    _resave(tmp_path, state)
    last = spec.num_all_layers - 1
    stage = GPTStage(spec, last, last, arch=arch)
    load_stage(stage, tmp_path)
    emb = model.state_dict()["model.embed_tokens.weight"]
    head = dict(stage.keyed_parameters())[f"{last}.lm_head.weight"].detach()
    assert torch.equal(head[: spec.vocab_size], emb)  # then the padded vocabulary's zero rows
    assert not head[spec.vocab_size :].any()


def test_a_non_zero_dropout_is_refused_by_name() -> None:
    """The engine has no dropout: GPT-2's and OPT's defaults (0.1) would train differently
    from transformers and Megatron, so they are refused, naming the field, until set to 0."""
    import transformers

    small = {"n_layer": 2, "n_embd": 32, "n_head": 4}
    with pytest.raises(UnsupportedConfigError, match=r"resid_pdrop=0\.1 .*set it to 0"):
        from_hf_config(transformers.GPT2Config(**small), 16)
    zero = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    with pytest.raises(UnsupportedConfigError, match=r"attn_pdrop=0\.1"):
        from_hf_config(transformers.GPT2Config(**small, **(zero | {"attn_pdrop": 0.1})), 16)
    from_hf_config(transformers.GPT2Config(**small, **zero), 16)
    opt = {"hidden_size": 32, "num_hidden_layers": 2, "ffn_dim": 64, "num_attention_heads": 4}
    with pytest.raises(UnsupportedConfigError, match=r"opt: dropout=0\.1"):
        from_hf_config(transformers.OPTConfig(**opt), 16)
    from_hf_config(transformers.OPTConfig(**opt, dropout=0.0), 16)
    llama = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 48,
    }
    from_hf_config(transformers.LlamaConfig(**llama), 16)  # 0 by default
    with pytest.raises(UnsupportedConfigError, match="attention_dropout"):
        from_hf_config(transformers.LlamaConfig(**llama, attention_dropout=0.1), 16)
