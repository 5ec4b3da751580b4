"""Import the original Sailor artifact's per-layer profiles into a ProfileDB.

Formats (see the artifact's README):
- ``profiles_tmp.json``: ``{model: {gpu: {mbs: {tp: {layer: [fwd_s, bwd_s, update_s]}}}}}``
- ``llm_info.json``: ``{model: {tp: {layer: {params_floats, act_output_floats, act_input_floats,
  act_mem_floats, ...}}}}`` at microbatch 1; ``act_mem_floats`` is the allocated-memory growth
  during forward divided by 4.

Every entry becomes ``source="imported"``. The artifact's known defects are kept as they are
(it timed two blocks and copied them; its embedding backward reads ~1 µs): the simulator, not
the importer, decides how to treat them, so the database stays a faithful copy.
"""

from __future__ import annotations

from pathlib import Path

from sailor.importers._read import ImportFormatError, as_float, as_int, get, load_json
from sailor.schemas import LayerProfile, LayerSize, ProfileDB
from sailor.schemas.model import LayerKind

__all__ = [
    "import_profiles",
    "import_sizes",
    "profile_models",
]


def profile_models(profiles_json: str | Path) -> list[str]:
    """Model names present in a ``profiles_tmp.json``."""
    data = load_json(profiles_json)
    if not isinstance(data, dict):
        raise ImportFormatError(profiles_json, "<root>", "expected an object keyed by model")
    return sorted(data)


def _kind(layer: int, n_layers: int) -> LayerKind:
    if layer == 0:
        return "embedding"
    if layer == n_layers - 1:
        return "head"
    return "block"


def import_profiles(
    profiles_json: str | Path,
    llm_info_json: str | Path | None,
    model: str,
    *,
    bytes_per_element: int = 2,
) -> ProfileDB:
    """Timings (and sizes, if ``llm_info_json`` is given) of ``model``.

    ``bytes_per_element`` converts the artifact's element counts of stage outputs into bytes
    sent between stages (2 for fp16/bf16 training, 4 for fp32).
    """
    data = load_json(profiles_json)
    mdata = get(data, model, profiles_json, model)
    timings: list[LayerProfile] = []
    for gpu, by_mbs in _items(mdata, profiles_json, model):
        for mbs_s, by_tp in _items(by_mbs, profiles_json, f"{model}.{gpu}"):
            mbs = as_int(mbs_s, profiles_json, f"{model}.{gpu}.<mbs>", min_value=1)
            for tp_s, by_layer in _items(by_tp, profiles_json, f"{model}.{gpu}.{mbs_s}"):
                tp = as_int(tp_s, profiles_json, f"{model}.{gpu}.{mbs_s}.<tp>", min_value=1)
                path = f"{model}.{gpu}.{mbs_s}.{tp_s}"
                layers = sorted(
                    (as_int(k, profiles_json, f"{path}.<layer>", min_value=0), v)
                    for k, v in _items(by_layer, profiles_json, path)
                )
                n = len(layers)
                if [i for i, _ in layers] != list(range(n)):
                    raise ImportFormatError(
                        profiles_json, path, "layers must be 0..N-1 without gaps"
                    )
                for i, triple in layers:
                    f = f"{path}.{i}"
                    if not isinstance(triple, list) or len(triple) < 3:
                        raise ImportFormatError(
                            profiles_json, f, f"expected [fwd, bwd, update], got {triple!r}"
                        )
                    timings.append(
                        LayerProfile(
                            gpu_type=gpu,
                            tp=tp,
                            microbatch_size=mbs,
                            layer=i,
                            kind=_kind(i, n),
                            fwd_s=as_float(triple[0], profiles_json, f + "[0]", min_value=0),
                            bwd_s=as_float(triple[1], profiles_json, f + "[1]", min_value=0),
                            update_s=as_float(triple[2], profiles_json, f + "[2]", min_value=0),
                            source="imported",
                        )
                    )
    sizes = import_sizes(llm_info_json, model, bytes_per_element) if llm_info_json else []
    return ProfileDB(
        model=model,
        timings=tuple(timings),
        sizes=tuple(sizes),
        meta={
            "tool": "sailor import sailor-profiles",
            "from": str(Path(profiles_json).name),
            "sizes_from": str(Path(llm_info_json).name) if llm_info_json else "",
        },
    )


def import_sizes(llm_info_json: str | Path, model: str, bpe: int) -> list[LayerSize]:
    data = load_json(llm_info_json)
    mdata = get(data, model, llm_info_json, model)
    out: list[LayerSize] = []
    for tp_s, by_layer in _items(mdata, llm_info_json, model):
        tp = as_int(tp_s, llm_info_json, f"{model}.<tp>", min_value=1)
        for layer_s, d in _items(by_layer, llm_info_json, f"{model}.{tp_s}"):
            layer = as_int(layer_s, llm_info_json, f"{model}.{tp_s}.<layer>", min_value=0)
            f = f"{model}.{tp_s}.{layer_s}"
            params = as_int(
                get(d, "params_floats", llm_info_json, f + ".params_floats"),
                llm_info_json,
                f + ".params_floats",
                min_value=0,
            )
            act_mem = as_int(
                get(d, "act_mem_floats", llm_info_json, f + ".act_mem_floats"),
                llm_info_json,
                f + ".act_mem_floats",
                min_value=0,
            )
            out_f = as_int(
                get(d, "act_output_floats", llm_info_json, f + ".act_output_floats"),
                llm_info_json,
                f + ".act_output_floats",
                min_value=0,
            )
            in_f = as_int(
                d.get("act_input_floats", 0) if isinstance(d, dict) else 0,
                llm_info_json,
                f + ".act_input_floats",
                min_value=0,
            )
            out.append(
                LayerSize(
                    tp=tp,
                    layer=layer,
                    params=params,
                    # act_mem_floats is the measured allocation growth / 4: bytes = floats * 4.
                    activation_bytes_per_sample=act_mem * 4,
                    output_bytes_per_sample=out_f * bpe,
                    input_bytes_per_sample=in_f * bpe,
                    source="imported",
                )
            )
    return out


def _items(d: object, file: str | Path, field: str) -> list[tuple[str, object]]:
    if not isinstance(d, dict):
        raise ImportFormatError(file, field, f"expected an object, got {type(d).__name__}")
    return [(str(k), v) for k, v in d.items()]
