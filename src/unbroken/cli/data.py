"""``unbroken data ...``: training data into the shapes the workloads read."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from unbroken.cli.common import Output, OutputOption, console, print_json, table
from unbroken.data.token_shards import tokenizer_summary

app = typer.Typer(
    help="Training data into the shapes unbroken's workloads read. Every command is resumable: killed and run again "
    "with the same arguments, it finishes with the same files as an uninterrupted run.\n\n"
    "Example:  unbroken data prepare-text corpus.txt --out data/corpus;  unbroken data imagenet-val ~/imagenet/val "
    "--solutions LOC_val_solution.csv",
    no_args_is_help=True,
)


@app.command("prepare-text")
def prepare_text_command(
    inputs: Annotated[list[Path], typer.Argument(help=".txt files (a document per line) or .jsonl files (a document per "
                                                 "line in its \"text\" field)", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Folder for tokenizer.json, index.json and the shards", show_default=False)],
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="Train a byte-level BPE of this many tokens on the inputs")] = 8192,
    tokenizer: Annotated[Path | None, typer.Option("--tokenizer", help="Use this tokenizer.json instead of training one "
                                                   "(it must have an <|endoftext|> token)", show_default=False)] = None,
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", help="Tokens per shard file")] = 2**24,
    output: OutputOption = Output.table,
) -> None:
    """Tokenize a text corpus into fixed-size token shards (uint16 or uint32 memmaps plus index.json) for the LLM workload.

    Deterministic: the same inputs and options give the same bytes. Resumable: run the same command again after an
    interruption and it continues where the index says; other options or changed inputs are refused.

    Example:  bible -f Gen1:1-Rev22:21 | cut -d' ' -f2- > kjv.txt;  unbroken data prepare-text kjv.txt --out data/kjv --vocab-size 4096
    """
    from unbroken.data.prepare_text import prepare_text

    with Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                  console=console, transient=True, disable=output is Output.json) as bar:
        task = bar.add_task("tokenizing", total=None)
        prepare_text(inputs, out, vocab_size=vocab_size, shard_tokens=shard_tokens, tokenizer=tokenizer,
                     progress=lambda done, total: bar.update(task, completed=done, total=total))
    _print_summary(out, output)


def _print_summary(folder: Path, output: Output) -> None:
    summary = tokenizer_summary(folder)
    if output is Output.json:
        print_json(summary)
        return
    rows = [[key, ", ".join(value) if isinstance(value, list) else value] for key, value in summary.items()]
    console.print(table(None, ["", ""], rows))


@app.command("imagenet-val")
def imagenet_val_command(
    val_dir: Annotated[Path, typer.Argument(help="ImageNet's flat val/ folder of ILSVRC2012_val_*.JPEG images", show_default=False)],
    solutions: Annotated[Path, typer.Option("--solutions", help="LOC_val_solution.csv (ImageId,PredictionString)", show_default=False)],
    output: OutputOption = Output.table,
) -> None:
    """Move ImageNet's validation images into one folder per class (val/<synset>/<image>.JPEG), the ImageFolder
    layout the ResNet workload reads. Safe to interrupt and run again; exits 1 if an image the CSV names is missing.

    Example:  unbroken data imagenet-val ~/imagenet/val --solutions ~/imagenet/LOC_val_solution.csv
    """
    from unbroken.data.imagenet_val import sort_into_classes

    with Progress(TextColumn("sorting"), BarColumn(), TextColumn("{task.completed}/{task.total} images"),
                  console=console, transient=True, disable=output is Output.json) as bar:
        task = bar.add_task("sorting", total=None)
        report = sort_into_classes(val_dir, solutions, progress=lambda done, total: bar.update(task, completed=done, total=total))
    summary = {"folder": str(val_dir), "classes": report.classes, "moved": report.moved, "already_in_place": report.already_in_place,
               "missing": len(report.missing), "not_in_solutions": report.not_in_solutions}
    if output is Output.json:
        print_json({**summary, "missing_images": report.missing})
    else:
        console.print(table(None, ["", ""], [[k, v] for k, v in summary.items()]))
        if report.missing:
            console.print(f"[yellow]missing:[/] {', '.join(report.missing[:10])}" + (" ..." if len(report.missing) > 10 else ""),
                          highlight=False)
    if report.missing:
        raise typer.Exit(1)
