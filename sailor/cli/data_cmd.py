"""``sailor data``: prepare a tokenized corpus (Megatron indexed dataset) and inspect one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from sailor.cli._io import fail

if TYPE_CHECKING:
    from sailor.data.prepared import PreparedData

__all__ = ["data_app"]

data_app = typer.Typer(help="Tokenized training data (Megatron .bin/.idx).", no_args_is_help=True)


@data_app.command("prepare")
def prepare_cmd(
    inputs: list[Path] = typer.Argument(
        None, help="Text files (one document each) or, with --jsonl-field, JSON-lines files."
    ),
    out: Path = typer.Option(..., "--out", help="Output prefix: OUT.bin/.idx/.json."),
    builtin_corpus: str | None = typer.Option(
        None,
        "--builtin-corpus",
        help="Text the Python installation ships instead of INPUTS: python-docs (~0.5 MB "
        "reference prose) or python-stdlib (~4.7 MB of Lib/*.py).",
    ),
    jsonl_field: str | None = typer.Option(
        None, "--jsonl-field", help="INPUTS are JSON lines; the document text is this field."
    ),
    tokenizer: Path | None = typer.Option(
        None,
        "--tokenizer",
        help="A tokenizers/transformers tokenizer.json, or a directory holding one (local).",
    ),
    vocab_size: int = typer.Option(
        4096, "--vocab-size", help="Without --tokenizer: train a byte-level BPE of this size."
    ),
    eod_token: str | None = typer.Option(
        None, "--eod-token", help="End-of-document token (default: <|endoftext|>, </s>, ...)."
    ),
    bos: str = typer.Option(
        "auto",
        "--bos",
        help="Token each document starts with: auto (the tokenizer's own, e.g. Llama's <s>; "
        "none for GPT-2 or a trained BPE), none, or a token.",
    ),
    validation_fraction: float = typer.Option(
        0.1, "--validation-fraction", help="Documents held out for validation."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the document shuffle before the split."),
    max_bytes: int | None = typer.Option(
        None, "--max-bytes", help="Stop reading after this much text (whole documents)."
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Tokenize text into a Megatron indexed dataset with a train/validation split."""
    from sailor.data import corpus
    from sailor.data.prepare import PrepareOptions, prepare

    if bool(builtin_corpus) == bool(inputs):
        raise fail("give INPUTS or --builtin-corpus (exactly one)")
    if builtin_corpus is not None:
        if builtin_corpus not in corpus.BUILTIN_CORPORA:
            known = ", ".join(corpus.BUILTIN_CORPORA)
            raise fail(f"--builtin-corpus={builtin_corpus!r} is unknown; known: {known}")
        docs = corpus.builtin_corpus(builtin_corpus)
        names: tuple[str, ...] = (builtin_corpus,)
        kind, version = "builtin", corpus.python_version()
    else:
        for p in inputs:
            if p.is_dir():
                raise fail(f"{p}: is a directory, a file is expected: pass its files")
            if not p.is_file():
                raise fail(f"{p}: no such file")
        docs = (
            corpus.jsonl_documents(inputs, jsonl_field)
            if jsonl_field
            else corpus.text_documents(inputs)
        )
        names = tuple(map(str, inputs))
        kind, version = ("jsonl" if jsonl_field else "text"), None
    if max_bytes is not None and max_bytes < 1:
        raise fail(f"--max-bytes={max_bytes}: must be at least 1 (bytes of text to read)")
    _check_out(out)
    if tokenizer is None:  # refused before any reading: a size past the bound aborts in Rust
        from sailor.data.tokenizer import check_trained_vocab

        try:
            check_trained_vocab(vocab_size, "--vocab-size")
        except ValueError as exc:
            raise fail(str(exc)) from exc
    opts = PrepareOptions(
        out=out,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        eod_token=eod_token,
        bos=bos,
        validation_fraction=validation_fraction,
        seed=seed,
        max_bytes=max_bytes,
        source_kind=kind,  # type: ignore[arg-type]
        source_inputs=names,
        source_field=jsonl_field,
        python_version=version,
    )
    if tokenizer is not None:  # a bad tokenizer is refused, by its name, before any reading
        from sailor.data.tokenizer import load_tokenizer

        try:
            load_tokenizer(tokenizer)
        except (ValueError, FileNotFoundError) as exc:
            raise fail(f"--tokenizer: {exc}") from exc
    console = Console(stderr=True)
    bar = Progress(
        TextColumn("{task.description:<16}"),  # read / train-tokenizer / tokenize
        BarColumn(),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
    )
    tasks: dict[str, TaskID] = {}

    def progress(phase: str, done: int, total: int) -> None:
        count = f"{done:,}/{total:,}" if total else f"{done:,}"
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=total or None, count=count)
        bar.update(tasks[phase], completed=done, total=total or None, count=count)

    try:
        with bar:
            m = prepare(docs, opts, progress)
    except OSError as exc:
        if exc.filename is not None and str(exc.filename).startswith(str(out)):
            # an output file (OUT.bin.tmp ...): the inputs are not to blame
            raise fail(
                f"--out {out}: cannot write {exc.filename} ({exc.strerror or exc})", code=1
            ) from exc
        if not isinstance(exc, FileNotFoundError):
            raise
        raise fail(f"{', '.join(names)}: {exc}") from exc
    except ValueError as exc:
        raise fail(f"{', '.join(names)}: {exc}") from exc
    tr, va = m.splits["train"], m.splits["validation"]
    typer.echo(
        f"{out}.bin/.idx: {m.num_documents} documents, {m.num_tokens:,} tokens "
        f"({m.dtype}), vocab {m.tokenizer.vocab_size} ({m.tokenizer.kind}), "
        f"eod {m.tokenizer.eod_token!r}={m.tokenizer.eod_id}"
        + (
            f", bos {m.tokenizer.bos_token!r}={m.tokenizer.bos_id}"
            if m.tokenizer.bos_id is not None
            else ""
        )
        + f"; train {tr.end - tr.first} docs "
        f"{tr.tokens:,} tokens, validation {va.end - va.first} docs {va.tokens:,} tokens"
    )


def _check_out(out: Path) -> None:
    """Before any reading: the output prefix's folder exists or can be made (a long
    tokenization must not end on an output that was never writable)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise fail(
            f"--out {out}: cannot create its folder {out.parent} ({exc.strerror or exc})"
        ) from exc


@data_app.command("info")
def info_cmd(
    prefix: Path = typer.Argument(..., help="Data set prefix (PREFIX.bin/.idx)."),
    scan: bool = typer.Option(
        True,
        "--scan/--no-scan",
        help="Read every token id to check it against the vocabulary (one pass over the "
        ".bin: minutes for a TB file); --no-scan checks the index and the manifest only.",
    ),
) -> None:
    """Check a data set (and its manifest) and print its counts and splits."""
    from sailor.data import IndexedDatasetError, open_prepared

    try:
        pd = open_prepared(prefix)
    except (IndexedDatasetError, ValueError, FileNotFoundError) as exc:
        raise fail(str(exc)) from exc
    ds = pd.dataset
    typer.echo(
        f"{ds.bin_path}: {pd.dataset.num_documents} documents, {len(ds)} sequences, "
        f"{ds.num_tokens:,} tokens, dtype {ds.dtype}"
    )
    for name, docs in pd.splits.items():
        typer.echo(f"  {name}: documents [{docs.start}, {docs.stop})")
    if pd.manifest is not None:
        t = pd.manifest.tokenizer
        bos = f", bos {t.bos_id}" if t.bos_id is not None else ""
        typer.echo(f"  tokenizer: {t.path} ({t.kind}), vocab {t.vocab_size}, eod {t.eod_id}{bos}")
    if scan:
        _check_ids(pd)
    else:
        typer.echo("  token ids: not read (--no-scan)")


def _check_ids(pd: PreparedData) -> None:
    """Read every id of the ``.bin`` once; print the range; fail on one outside the
    manifest's vocabulary (or a negative one): training would meet it in some batch, maybe
    hours in (the engine checks each batch, ``megatron_patch.data.IndexedTokens``)."""
    from sailor.data.scan import id_range

    ds, vocab = pd.dataset, pd.vocab_size
    ids = id_range(ds, vocab)
    typer.echo(f"  token ids: {ids.low}..{ids.high}" + (f" (vocab {vocab})" if vocab else ""))
    if ids.first_bad is None:
        return
    offset, value = ids.first_bad
    what = f"the manifest's vocabulary [0, {vocab})" if vocab else "[0, any vocabulary)"
    raise fail(
        f"{ds.bin_path}: token id {value} at token {offset} (byte {offset * ds.dtype.itemsize}) "
        f"is outside {what}, {ids.bad} such id(s) in all (largest {ids.high}): the .bin was "
        "written with another tokenizer or is damaged; prepare it again (sailor data prepare)"
    )
