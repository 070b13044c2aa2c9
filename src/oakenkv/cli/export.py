"""``oakenkv export``: a model directory vLLM serves with Oaken's KV cache (docs/vllm.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from oakenkv.cli._common import ModelOption, app, bad_option, check_model, load_thresholds


@app.command("export")
def export_cmd(
    out: Annotated[Path, typer.Option(help="The directory to write (new, or a previous export, which is replaced).")],
    model: ModelOption = "default",
    preset: Annotated[
        str,
        typer.Option(
            help="'oaken-plus' (default): the profile's weight transforms folded into the written weights, its "
            "online parts applied by the vLLM plugin. 'oaken': the paper's thresholds, weights unchanged."
        ),
    ] = "oaken-plus",
    profile: Annotated[
        Path | None,
        typer.Option(
            help="A profile of the preset for this model (`oakenkv profile`); default: the one OakenCache.for_model "
            "uses (shipped for an embedded model, cached by content, or made now on the calibration text).",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
    ] = None,
    static_grids: Annotated[
        bool,
        typer.Option(
            "--static-grids",
            help="Store each token's outer scales alone, the middle and inner grids fixed per layer by its "
            "thresholds (0.33 bit per value less on the default model at the same accuracy; docs/format.md).",
        ),
    ] = False,
) -> None:
    """Write a Hugging Face model directory (folded safetensors weights, config, generation config, tokenizer)
    with its Oaken profile inside (oakenkv-profile.json): `python -m vllm.entrypoints.openai.api_server --model
    OUT` then serves it with Oaken's KV cache (the oakenkv vLLM plugin finds the profile there)."""
    from oakenkv.calibrate.presets import PRESETS
    from oakenkv.integrations.vllm import slot_refusal
    from oakenkv.integrations.vllm.export import check_export_dir

    if preset not in PRESETS:
        raise bad_option("--preset", f"must be one of {', '.join(PRESETS)}, got {preset!r}")
    refused = slot_refusal(PRESETS[preset].middle_bits)
    if refused is not None:
        raise bad_option("--preset", f"{preset}: {refused}; export 'oaken-plus' or 'oaken'")
    try:
        check_export_dir(out)
    except ValueError as e:
        raise bad_option("--out", str(e).removeprefix("--out ").strip()) from None
    check_model(model)
    thr = load_thresholds(profile, model)  # (its shape against the model's config too, before the model loads)
    if thr is not None:  # before the model loads, in the flags' words (find_profile says it in the API's)
        has, wants = thr.transforms is not None, PRESETS[preset].transforms
        if has != wants:
            kind = "has oaken-plus transforms" if has else "has no oaken-plus transforms"
            raise bad_option(
                "--profile",
                f"{profile} {kind}, so it is not a profile of --preset {preset}; use --preset "
                f"{'oaken-plus' if has else 'oaken'}, or a profile made with `oakenkv profile --preset {preset}`",
            )
        slot, wants_slot = thr.config.middle_bits, PRESETS[preset].middle_bits
        if slot != wants_slot:
            raise bad_option(
                "--profile",
                f"{profile} quantizes to {slot}-bit dense slots, --preset {preset} to {wants_slot}-bit ones; use a "
                f"profile made with `oakenkv profile --preset {preset}`",
            )
    from oakenkv.assets.models import load_model
    from oakenkv.integrations.vllm.export import export_model

    loaded = load_model(model)
    folded_in, saved = loaded.model.dtype, _saved_dtype(loaded.source)
    cast = saved if saved is not None and saved.is_floating_point and saved != folded_in else None
    path = export_model(
        loaded.model,
        loaded.tokenizer,
        out,
        preset,
        profile=thr,
        source=str(loaded.source),
        static_grids=static_grids,
        dtype=cast,
    )
    kind = ", static grids" if static_grids else ""
    written = loaded.model.dtype
    if cast is not None:
        typer.echo(
            f"note: {model} is saved in {_name(saved)}: oakenkv loaded it in {_name(folded_in)}, folded the profile "
            f"there and wrote the export in {_name(written)}, as the checkpoint was",
            err=True,
        )
    typer.echo(
        f"wrote {out} ({preset}{kind}, {_name(written)} weights; profile {path.name}); serve it with: "
        f"python -m vllm.entrypoints.openai.api_server --model {out.resolve()} --dtype bfloat16 --enforce-eager"
    )


def _saved_dtype(source: Any) -> Any:
    """The ``torch.dtype`` the checkpoint's config says its weights are saved in (transformers' reading of it), None
    when unknown."""
    import torch
    from transformers import AutoConfig

    try:
        dtype = AutoConfig.from_pretrained(str(source)).dtype
    except (OSError, ValueError):
        return None
    return dtype if isinstance(dtype, torch.dtype) else None


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
