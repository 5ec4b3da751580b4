"""``sailor data prepare`` end to end on small corpora: text, JSONL, a tokenizer file, the
built-in Python corpora; the result opens as a data set with its manifest."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner, Result

from sailor.cli.main import app
from sailor.data import open_prepared
from sailor.data.corpus import builtin_corpus
from sailor.schemas.dataset import DatasetManifest

runner = CliRunner()

_SENTENCE = (
    "the pipeline stage sends activations to the next stage while the optimizer waits for "
    "gradients from every replica of the layer and the planner prices each plan"
)
_WORDS = _SENTENCE.split()


def _texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [
        " ".join(rng.choice(_WORDS, int(rng.integers(20, 80)))) + f". Document {i}."
        for i in range(n)
    ]


def _prepare(*args: str) -> DatasetManifest:
    res = runner.invoke(app, ["data", "prepare", *args, "--quiet"])
    assert res.exit_code == 0, res.output
    out = Path(args[args.index("--out") + 1])
    return DatasetManifest.model_validate_json(out.with_suffix(".json").read_text())


def test_text_files_end_to_end(tmp_path: Path) -> None:
    texts = _texts(30)
    files = []
    for i, t in enumerate(texts):
        files.append(tmp_path / f"doc{i:02}.txt")
        files[-1].write_text(t)
    (tmp_path / "empty.txt").write_text("  \n")
    out = tmp_path / "out" / "corpus"
    m = _prepare(
        *map(str, files),
        str(tmp_path / "empty.txt"),
        "--out",
        str(out),
        "--vocab-size",
        "300",
        "--validation-fraction",
        "0.2",
    )
    assert m.num_documents == 30  # the empty file is skipped
    assert m.splits["train"].documents == range(0, 24)
    assert m.splits["validation"].documents == range(24, 30)
    assert m.tokenizer.kind == "trained-bpe" and m.tokenizer.vocab_size == 300
    assert (m.tokenizer.eod_token, m.tokenizer.eod_id) == ("<|endoftext|>", 0)
    assert m.tokenizer.bos_id is None  # a trained BPE's template puts nothing before a text
    assert m.dtype == "uint16" and m.source.kind == "text"

    pd = open_prepared(out)
    ds = pd.dataset
    tok = Tokenizer.from_file(str(out.parent / m.tokenizer.path))
    decoded = []
    for d in range(ds.num_documents):
        ids = ds.document_tokens(d, d + 1).tolist()
        assert ids[-1] == 0 and 0 not in ids[:-1]  # one EOD, at the end
        decoded.append(tok.decode(ids[:-1]))
    assert sorted(decoded) == sorted(texts)  # byte-level BPE round-trips every text
    assert decoded != texts  # documents were shuffled before the split
    assert sum(len(ds[i]) for i in range(len(ds))) == m.num_tokens

    # deterministic: the same inputs give the same bytes
    again = tmp_path / "again" / "corpus"
    _prepare(
        *map(str, files), "--out", str(again), "--vocab-size", "300", "--validation-fraction", "0.2"
    )
    for suffix in (".bin", ".idx"):
        assert again.with_suffix(suffix).read_bytes() == out.with_suffix(suffix).read_bytes()


def test_jsonl_with_a_tokenizer_file(tmp_path: Path) -> None:
    first = tmp_path / "a" / "c"
    texts = _texts(12)
    txt = tmp_path / "t.txt"
    txt.write_text("\n".join(texts))
    m0 = _prepare(
        str(txt), "--out", str(first), "--vocab-size", "280", "--validation-fraction", "0"
    )
    assert m0.splits["validation"].documents == range(1, 1)
    tok_dir = tmp_path / "tok"  # as transformers' save_pretrained leaves a fast tokenizer
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_bytes((first.parent / m0.tokenizer.path).read_bytes())

    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"id": i, "content": t}) for i, t in enumerate(texts)))
    out = tmp_path / "b" / "c"
    m = _prepare(
        str(jl),
        "--jsonl-field",
        "content",
        "--tokenizer",
        str(tok_dir),
        "--out",
        str(out),
        "--validation-fraction",
        "0.25",
    )
    assert m.tokenizer.kind == "file" and m.tokenizer.vocab_size == 280
    assert m.source.kind == "jsonl" and m.source.field == "content"
    assert m.num_documents == 12 and m.splits["validation"].documents == range(9, 12)

    jl.write_text(json.dumps({"content": "x"}) + "\n" + json.dumps({"text": "y"}) + "\n")
    res = runner.invoke(
        app,
        [
            "data",
            "prepare",
            str(jl),
            "--jsonl-field",
            "content",
            "--out",
            str(tmp_path / "bad"),
            "--quiet",
        ],
    )
    assert res.exit_code == 2
    assert f"{jl}:2: no field 'content'" in res.output


def test_a_tokenizer_files_truncation_and_padding_are_not_applied(tmp_path: Path) -> None:
    """A tokenizer.json saved after a ``truncation=True, padding=...`` call keeps both
    settings; ``transformers`` applies them only when asked, so must we: the documents come
    out whole and unpadded, the same as with the plain file."""
    texts = _texts(8)
    txt = tmp_path / "t.txt"
    txt.write_text("\n".join(texts))
    plain = _prepare(
        str(txt), "--out", str(tmp_path / "a" / "c"), "--vocab-size", "280",
        "--validation-fraction", "0",
    )  # fmt: skip
    tok = Tokenizer.from_file(str(tmp_path / "a" / plain.tokenizer.path))
    tok.enable_truncation(4)
    tok.enable_padding(length=64, pad_id=1)
    saved = tmp_path / "tok.json"
    tok.save(str(saved))
    assert json.loads(saved.read_text())["truncation"] is not None
    got = _prepare(
        str(txt), "--tokenizer", str(saved), "--out", str(tmp_path / "b" / "c"),
        "--validation-fraction", "0",
    )  # fmt: skip
    assert got.num_tokens == plain.num_tokens
    a = open_prepared(tmp_path / "a" / "c")
    b = open_prepared(tmp_path / "b" / "c")
    assert len(a.dataset) == len(b.dataset) > 0
    for i in range(len(a.dataset)):
        assert np.array_equal(a.dataset[i], b.dataset[i]), i


def test_eod_token_must_exist(tmp_path: Path) -> None:
    txt = tmp_path / "t.txt"
    txt.write_text(" ".join(_texts(3)))
    res = runner.invoke(
        app,
        [
            "data",
            "prepare",
            str(txt),
            "--out",
            str(tmp_path / "o"),
            "--vocab-size",
            "280",
            "--eod-token",
            "<eos>",
            "--validation-fraction",
            "0",
            "--quiet",
        ],
    )
    # the trained BPE gets the requested EOD as its special token
    assert res.exit_code == 0, res.output
    m = DatasetManifest.model_validate_json((tmp_path / "o.json").read_text())
    assert m.tokenizer.eod_token == "<eos>" and m.tokenizer.eod_id == 0
    res = runner.invoke(
        app,
        [
            "data",
            "prepare",
            str(txt),
            "--out",
            str(tmp_path / "p"),
            "--tokenizer",
            str(tmp_path / "o.tokenizer.json"),
            "--eod-token",
            "</s>",
            "--validation-fraction",
            "0",
            "--quiet",
        ],
    )
    assert res.exit_code == 2 and "eod_token='</s>': not in the tokenizer's vocabulary" in (
        res.output
    )


def _llama_style(tmp_path: Path, texts: list[str], prefix: tuple[str, ...] = ("<s>",)) -> Path:
    """A byte-level BPE whose template starts every text with ``prefix`` and ends none, as
    Llama's tokenizer.json does (``</s>`` its end-of-document token)."""
    from tokenizers import processors

    from sailor.data.tokenizer import train_byte_bpe

    tok = train_byte_bpe(texts, 300, "</s>")
    tok.add_special_tokens(list(prefix))
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join([*prefix, "$A"]),
        special_tokens=[(t, tok.token_to_id(t)) for t in prefix],
    )
    path = tmp_path / "llama-style.json"
    tok.save(str(path))
    return path


def test_documents_start_with_the_tokenizers_bos(tmp_path: Path) -> None:
    """--bos auto (the default) puts the id the tokenizer's own template starts a text with
    before each document (Llama's <s>); --bos none puts nothing; a named token must exist."""
    texts = _texts(6)
    tok_path = _llama_style(tmp_path, texts)
    tok = Tokenizer.from_file(str(tok_path))
    bos, eod = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"t": t}) for t in texts))
    common = ["--jsonl-field", "t", "--tokenizer", str(tok_path), "--validation-fraction", "0"]
    out = tmp_path / "auto"
    m = _prepare(str(jl), "--out", str(out), *common)
    assert (m.tokenizer.bos_token, m.tokenizer.bos_id) == ("<s>", bos)
    assert (m.tokenizer.eod_token, m.tokenizer.eod_id) == ("</s>", eod)
    ds = open_prepared(out).dataset
    decoded = []
    for d in range(ds.num_documents):
        ids = ds.document_tokens(d, d + 1).tolist()
        assert ids[0] == bos and ids[-1] == eod and bos not in ids[1:] and eod not in ids[:-1]
        decoded.append(tok.decode(ids[1:-1]))
    assert sorted(decoded) == sorted(texts)
    assert m.num_tokens == sum(len(tok.encode(t, add_special_tokens=False).ids) + 2 for t in texts)

    none = tmp_path / "none"
    m = _prepare(str(jl), "--out", str(none), *common, "--bos", "none")
    assert m.tokenizer.bos_id is None
    ds = open_prepared(none).dataset
    assert all(bos not in ds.document_tokens(d, d + 1).tolist() for d in range(6))

    named = _prepare(str(jl), "--out", str(tmp_path / "named"), *common, "--bos", "</s>")
    assert named.tokenizer.bos_id == eod
    res = runner.invoke(
        app, ["data", "prepare", str(jl), "--out", str(tmp_path / "x"), *common, "--bos", "<b>"]
    )
    assert res.exit_code == 2
    assert "bos_token='<b>': not in the tokenizer's vocabulary" in res.output
    assert not (tmp_path / "x.json").exists()


def test_a_template_with_two_leading_tokens_asks_which(tmp_path: Path) -> None:
    from sailor.data.tokenizer import bos_of

    tok = Tokenizer.from_file(str(_llama_style(tmp_path, _texts(4), ("<s>", "<x>"))))
    with pytest.raises(ValueError, match=r"puts 2 ids .* name the one"):
        bos_of(tok, "auto")
    assert bos_of(tok, "<x>") == ("<x>", tok.token_to_id("<x>"))
    assert bos_of(tok, "none") is None


def test_builtin_python_docs(tmp_path: Path) -> None:
    out = tmp_path / "pydocs"
    m = _prepare(
        "--builtin-corpus",
        "python-docs",
        "--out",
        str(out),
        "--vocab-size",
        "512",
        "--max-bytes",
        "80000",
    )
    assert m.source.kind == "builtin" and m.source.inputs == ("python-docs",)
    assert m.source.python_version and m.source.python_version.startswith("cpython 3.")
    assert m.source.bytes >= 80000 and m.num_tokens > 10000
    pd = open_prepared(out)
    assert pd.tokens("validation", 16, 0).num_windows > 10
    res = runner.invoke(app, ["data", "info", str(out)])
    assert res.exit_code == 0 and "validation: documents" in res.output


def test_builtin_corpora_exist_here() -> None:
    docs = list(itertools.islice(builtin_corpus("python-stdlib"), 2))
    assert len(docs) == 2 and docs[0][0].endswith(".py") and len(docs[0][1]) > 100
    name, text = next(builtin_corpus("python-docs"))
    assert name.startswith("pydoc_data.topics") and len(text) > 100
    with pytest.raises(ValueError, match="builtin corpus 'nope' is unknown"):
        next(builtin_corpus("nope"))


def test_cli_refusals(tmp_path: Path) -> None:
    res = runner.invoke(app, ["data", "prepare", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "give INPUTS or --builtin-corpus" in res.output
    res = runner.invoke(app, ["data", "prepare", "--builtin-corpus", "wiki", "--out", "o"])
    assert res.exit_code == 2 and "--builtin-corpus='wiki' is unknown" in res.output
    (tmp_path / "x.idx").write_bytes(b"garbage")
    (tmp_path / "x.bin").write_bytes(b"")
    res = runner.invoke(app, ["data", "info", str(tmp_path / "x")])
    assert res.exit_code == 2 and "x.idx: at byte 0" in res.output


def test_outputs_never_overwrite_an_input(tmp_path: Path) -> None:
    """``--out corpus`` beside ``corpus.json`` (a JSON-lines input) would replace the text
    with the manifest; an input named like the tokenizer copy, or the .bin, likewise."""

    def prepare(*args: str) -> Result:
        return runner.invoke(app, ["data", "prepare", *args, "--quiet"])

    corpus = tmp_path / "corpus.json"
    lines = "".join(json.dumps({"text": t}) + "\n" for t in _texts(8))
    corpus.write_text(lines)
    res = prepare(str(corpus), "--jsonl-field", "text", "--out", str(tmp_path / "corpus"))
    assert res.exit_code == 2, res.output
    assert "would overwrite the input" in res.output and "corpus.json" in res.output
    assert corpus.read_text() == lines  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.json"]  # nothing written
    text = tmp_path / "d.bin"
    text.write_text(" ".join(_texts(4)))
    res = prepare(str(text), "--out", str(tmp_path / "d"))
    assert res.exit_code == 2 and "would overwrite the input" in res.output, res.output
    # the tokenizer file read by the run is an input too
    made = _prepare(str(corpus), "--jsonl-field", "text", "--out", str(tmp_path / "a"))
    tok = tmp_path / made.tokenizer.path
    before = tok.read_bytes()
    res = prepare(
        str(corpus), "--jsonl-field", "text", "--tokenizer", str(tok), "--out", str(tmp_path / "a")
    )
    assert res.exit_code == 2 and "would overwrite the tokenizer" in res.output, res.output
    assert tok.read_bytes() == before


def test_data_prepared_with_another_tokenizer_than_the_models_is_refused(
    tmp_path: Path,
) -> None:
    """A pretrained model reads token ids as its own tokenizer made them: data prepared with
    another one (by default a BPE trained on the corpus) is refused, naming both files and
    the first token that differs; the model's own tokenizer, even saved again with other
    settings, passes."""
    from sailor.megatron_patch.data import check_tokenizer
    from sailor.schemas.training import IndexedData

    texts = _texts(10)
    txt = tmp_path / "t.txt"
    txt.write_text("\n".join(texts))
    no_val = ("--validation-fraction", "0")
    own = _prepare(str(txt), "--out", str(tmp_path / "own" / "c"), "--vocab-size", "300", *no_val)
    model = tmp_path / "model"  # a transformers directory with its tokenizer
    model.mkdir()
    tok = Tokenizer.from_file(str(tmp_path / "own" / own.tokenizer.path))
    tok.enable_truncation(16)  # the same vocabulary, other bytes
    tok.save(str(model / "tokenizer.json"))
    check_tokenizer(IndexedData(prefix=str(tmp_path / "own" / "c")), model)

    other = _prepare(
        str(txt), "--out", str(tmp_path / "other" / "c"), "--vocab-size", "280", *no_val
    )
    data = IndexedData(prefix=str(tmp_path / "other" / "c"))
    with pytest.raises(ValueError, match=r"300 token ids against 280|not the model's"):
        check_tokenizer(data, model)
    with pytest.raises(ValueError, match="prepare it with --tokenizer"):
        check_tokenizer(data, model)
    assert other.tokenizer.vocab_size == 280
    # as many ids, another corpus: other merges
    txt2 = tmp_path / "u.txt"
    txt2.write_text("\n".join(t[::-1].upper() for t in texts))
    _prepare(str(txt2), "--out", str(tmp_path / "rev" / "c"), "--vocab-size", "300", *no_val)
    with pytest.raises(ValueError, match=r"token .* is id \d+ in the first"):
        check_tokenizer(IndexedData(prefix=str(tmp_path / "rev" / "c")), model)
    # nothing to compare: no tokenizer.json in the model's directory
    (model / "tokenizer.json").unlink()
    check_tokenizer(data, model)


def test_ids_outside_the_manifests_vocabulary_are_found_by_info_and_each_batch(
    tmp_path: Path,
) -> None:
    """A .bin whose ids its manifest's tokenizer cannot produce (another tokenizer's, or
    damaged): before, `data info` passed it and so did build_dataset (it compares the
    manifest's vocabulary with the model's, not the ids), and the embedding raised on it."""
    from sailor import catalog
    from sailor.megatron_patch.data import build_dataset
    from sailor.megatron_patch.vocab_parallel import LabelOutOfRangeError
    from sailor.schemas.training import IndexedData

    out = tmp_path / "pydocs"
    m = _prepare(
        "--builtin-corpus", "python-docs", "--out", str(out), "--vocab-size", "296",
        "--max-bytes", "20000",
    )  # fmt: skip
    res = runner.invoke(app, ["data", "info", str(out)])
    assert res.exit_code == 0 and "token ids: 0.." in res.output and "(vocab 296)" in res.output
    bin_path = out.with_suffix(".bin")
    toks = np.memmap(bin_path, dtype=np.uint16, mode="r+")
    toks[1234] = 65000
    toks.flush()
    del toks
    res = runner.invoke(app, ["data", "info", str(out)])
    assert res.exit_code == 2, res.output
    assert f"{bin_path}: token id 65000 at token 1234 (byte 2468)" in " ".join(res.output.split())
    assert "[0, 296)" in res.output
    quick = runner.invoke(app, ["data", "info", str(out), "--no-scan"])  # index and manifest
    assert quick.exit_code == 0 and "token ids: not read (--no-scan)" in quick.output
    spec = catalog.model("tiny-gpt").model_copy(update={"vocab_size": 70_000})
    data = build_dataset(IndexedData(prefix=str(out)), spec, seed=0)  # passes: 296 <= 70000
    assert m.tokenizer.vocab_size == 296
    with pytest.raises(LabelOutOfRangeError, match=r"holds token id 65000 at position") as exc:
        data.batch(range(data.tokens.num_windows))
    assert str(bin_path) in str(exc.value) and "of the manifest" in str(exc.value)


@pytest.mark.parametrize("size", [2**31, 2**30, 2**24 + 1])
def test_a_vocab_size_the_trainer_cannot_reserve_is_refused_by_name(
    tmp_path: Path, size: int
) -> None:
    """In a process of its own: before, 2^31 (and 2^30: 70.9 GB reserved) aborted in the
    tokenizers trainer (Rust), a SIGABRT with no Python error."""
    import subprocess
    import sys

    argv = ["data", "prepare", "--builtin-corpus", "python-docs", "--out", str(tmp_path / "o")]
    res = subprocess.run(
        [sys.executable, "-m", "sailor.cli.main", *argv, "--vocab-size", str(size)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert f"--vocab-size={size}: a byte-level BPE is trained with 258 to 16777216" in res.stderr
    assert not (tmp_path / "o.bin").exists()


def _holey_tokenizer(path: Path, top: int) -> Path:
    """A word-level tokenizer whose ids have a gap: a, b, [UNK], </s> at 0-3, c at ``top``."""
    from tokenizers import models, pre_tokenizers

    vocab = {"a": 0, "b": 1, "[UNK]": 2, "</s>": 3, "c": top}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    tok.save(str(path))
    return path


@pytest.mark.parametrize(("top", "dtype"), [(300, np.uint16), (70_000, np.int32)])
def test_a_tokenizer_with_id_gaps_bounds_the_vocabulary_by_its_largest_id(
    tmp_path: Path, top: int, dtype: type[np.generic]
) -> None:
    """The manifest's vocab_size is the largest id + 1, not the count of ids (5 here): with
    the count, every batch holding c failed as out of the vocabulary, and an id above
    uint16's range was written as uint16 (refused by the writer: the prepare failed)."""
    from sailor import catalog
    from sailor.megatron_patch.data import build_dataset
    from sailor.schemas.training import IndexedData

    txt = tmp_path / "t.txt"
    txt.write_text(" ".join("abc"[j % 3] for j in range(200)))
    tok = _holey_tokenizer(tmp_path / "tok.json", top)
    out = tmp_path / "ds"
    m = _prepare(
        str(txt), "--tokenizer", str(tok), "--out", str(out), "--eod-token", "</s>",
        "--validation-fraction", "0",
    )  # fmt: skip
    assert m.tokenizer.vocab_size == top + 1 and m.tokenizer.eod_id == 3
    pd = open_prepared(out)
    assert pd.dataset.dtype == np.dtype(dtype)
    assert top in set(np.concatenate([pd.dataset[i] for i in range(len(pd.dataset))]).tolist())
    res = runner.invoke(app, ["data", "info", str(out)])
    assert res.exit_code == 0 and f"(vocab {top + 1})" in res.output, res.output
    spec = catalog.model("tiny-gpt").model_copy(update={"vocab_size": top + 1, "seq_length": 16})
    data = build_dataset(IndexedData(prefix=str(out)), spec, seed=0)
    data.batch(range(data.tokens.num_windows))  # every id is inside the vocabulary


def test_a_jsonl_line_nested_past_the_parsers_limit_is_named(tmp_path: Path) -> None:
    """json raises RecursionError, not a JSONDecodeError, on "[[[...": named like any other
    bad line, not a traceback."""
    from sailor.data.corpus import jsonl_documents

    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n' + "[" * 5000 + "\n")
    with pytest.raises(ValueError, match=r"c\.jsonl:2: not JSON: nested too deep"):
        list(jsonl_documents([path], "text"))


def test_a_manifest_of_another_token_dtype_is_refused(tmp_path: Path) -> None:
    """The manifest says int32, the .idx (and .bin) uint16: another preparation's files
    beside it. Refused by name (noticed by review: counts were compared, not the dtype)."""
    import json as _json

    from sailor.data.indexed import IndexedDatasetError
    from sailor.data.prepared import open_prepared

    out = tmp_path / "pydocs"
    _prepare(
        "--builtin-corpus", "python-docs", "--out", str(out), "--vocab-size", "296",
        "--max-bytes", "20000",
    )  # fmt: skip
    assert open_prepared(out).dataset.dtype.name == "uint16"
    mpath = out.with_suffix(".json")
    doc = _json.loads(mpath.read_text())
    doc["dtype"] = "int32"
    mpath.write_text(_json.dumps(doc))
    want = r"token dtype uint16, the manifest .* says int32"
    with pytest.raises(IndexedDatasetError, match=want):
        open_prepared(out)


def test_an_interrupted_preparation_never_leaves_the_old_manifest_over_new_files(
    tmp_path: Path,
) -> None:
    """The manifest is the data set's commit. Re-preparing the same corpus with another seed
    gives files of the same counts: before, a run that failed after the new files replaced
    the old ones (here its manifest's temporary name is taken by a directory) left the old
    manifest, which opened them as valid with the old seed and split token counts. Now they
    open without a manifest. A run stopped while tokenizing leaves the old data set whole."""
    from sailor.data.prepare import PrepareOptions, prepare

    docs = [(f"d{i}", t) for i, t in enumerate(_texts(40))]
    out = tmp_path / "c"
    first = prepare(docs, PrepareOptions(out=out, vocab_size=300, seed=1))
    old_files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def stop(stage: str, done: int, total: int) -> None:
        if stage == "tokenize":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(docs, PrepareOptions(out=out, vocab_size=300, seed=2), progress=stop)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old_files
    assert open_prepared(out).manifest == first

    (tmp_path / "c.json.tmp").mkdir()
    with pytest.raises(IsADirectoryError):
        prepare(docs, PrepareOptions(out=out, vocab_size=300, seed=2))
    opened = open_prepared(out)
    assert opened.manifest is None, opened.manifest
    assert opened.dataset.num_documents == first.num_documents
    (tmp_path / "c.json.tmp").rmdir()
    again = prepare(docs, PrepareOptions(out=out, vocab_size=300, seed=2))
    assert open_prepared(out).manifest == again and again.shuffle_seed == 2
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_a_manifest_tokenizer_outside_the_data_sets_directory_is_refused(
    tmp_path: Path, how: str
) -> None:
    """``tokenizer.path`` is relative to the manifest's directory: one that resolves outside
    it (absolute, ``..``, a symlink out) was read as it stood, so a manifest could make the
    tokenizer check open any file. Refused, naming the field and the value."""
    from sailor.megatron_patch.data import check_tokenizer
    from sailor.schemas.training import IndexedData

    txt = tmp_path / "t.txt"
    txt.write_text("\n".join(_texts(10)))
    made = _prepare(str(txt), "--out", str(tmp_path / "own" / "c"), "--validation-fraction", "0")
    model = tmp_path / "model"
    model.mkdir()
    outside = model / "tokenizer.json"  # a file outside the data set's directory
    outside.write_bytes((tmp_path / "own" / made.tokenizer.path).read_bytes())
    check_tokenizer(IndexedData(prefix=str(tmp_path / "own" / "c")), model)  # its own: fine
    value = {"absolute": str(outside), "dotdot": "../model/tokenizer.json", "symlink": "ln.json"}[
        how
    ]
    if how == "symlink":
        (tmp_path / "own" / "ln.json").symlink_to(outside)
    manifest = tmp_path / "own" / "c.json"
    raw = json.loads(manifest.read_text())
    raw["tokenizer"]["path"] = value
    manifest.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="outside the data set's directory") as err:
        check_tokenizer(IndexedData(prefix=str(tmp_path / "own" / "c")), model)
    assert f"tokenizer.path={value!r}" in str(err.value)
