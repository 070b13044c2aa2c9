"""The ``oakenkv`` command line. Thin: each command parses its arguments and calls the library.

Commands import their library modules inside the function body so that ``oakenkv --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="oakenkv",
    help="Oaken KV-cache quantization (ISCA 2025): profile thresholds, quantize the KV cache of a transformers "
    "model into a fused dense-and-sparse 4.8-bit format, evaluate it against its peers and simulate the "
    "Oaken accelerator.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def info() -> None:
    """Print versions, thread counts, and where the default model and each data source were found."""
    from oakenkv.report_info import print_info

    print_info()


@app.command()
def demo(
    model: Annotated[
        str, typer.Option(help="Model: 'default', a Hugging Face id, a local directory or a .gguf path.")
    ] = "default",
    windows: Annotated[int, typer.Option(help="Number of WikiText-2 windows for perplexity.")] = 4,
    window: Annotated[int, typer.Option(help="Tokens per perplexity window.")] = 512,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate greedily.")] = 32,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results to this JSON file.")] = None,
) -> None:
    """Run the main job on the default model: perplexity on WikiText-2 windows and a greedy generation."""
    from oakenkv.demo import run_demo

    run_demo(model=model, windows=windows, window=window, max_new_tokens=max_new_tokens, json_out=json_out)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
