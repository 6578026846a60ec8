"""``unbroken data imagenet-val`` on a generated ImageNet-shaped val/: the layout it makes, a re-run
from any partial state, and the inputs it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cli
from imagenet_fixture import SYNSETS, make_imagenet_val
from unbroken.data.imagenet_val import sort_into_classes
from unbroken.errors import ConfigError
from unbroken.workloads.image_folder import ImageFolder


def layout(val: Path) -> dict[str, bytes]:
    return {str(p.relative_to(val)): p.read_bytes() for p in sorted(val.rglob("*")) if p.is_file()}


def test_images_move_into_their_class_folders_and_read_as_an_image_folder(tmp_path: Path) -> None:
    val, solutions = make_imagenet_val(tmp_path, classes=3, per_class=4)
    flat = {p.name: p.read_bytes() for p in val.iterdir()}
    report = sort_into_classes(val, solutions)
    assert (report.moved, report.already_in_place, report.missing, report.classes) == (12, 0, [], 3)
    after = layout(val)
    assert sorted(Path(k).name for k in after) == sorted(flat) and all(after[k] == flat[Path(k).name] for k in after)
    assert {Path(k).parent.name for k in after} == set(SYNSETS[:3])
    images = ImageFolder(val, 32, train=True)
    assert images.classes == SYNSETS[:3] and len(images) == 12
    pixels, label = images[5]
    assert pixels.shape == (3, 32, 32) and label == images.samples[5][1]
    images.epoch = 1
    assert not (images[5][0] == pixels).all(), "another epoch draws another crop"


def test_a_rerun_from_a_half_moved_folder_ends_in_the_same_layout(tmp_path: Path) -> None:
    reference_val, solutions = make_imagenet_val(tmp_path / "a", classes=3, per_class=4)
    sort_into_classes(reference_val, solutions)
    val, solutions = make_imagenet_val(tmp_path / "b", classes=3, per_class=4)
    # as a run killed after a third of the renames leaves it
    for line in solutions.read_text().splitlines()[1:5]:
        image, synset = line.split(",")[0], line.split(",")[1].split()[0]
        (val / synset).mkdir(exist_ok=True)
        (val / f"{image}.JPEG").rename(val / synset / f"{image}.JPEG")
    report = sort_into_classes(val, solutions)
    assert (report.moved, report.already_in_place) == (8, 4)
    assert layout(val) == layout(reference_val)
    again = sort_into_classes(val, solutions)
    assert (again.moved, again.already_in_place, again.missing) == (0, 12, [])


def test_a_missing_image_is_reported_and_an_unlisted_one_left_alone(tmp_path: Path) -> None:
    val, solutions = make_imagenet_val(tmp_path, classes=2, per_class=3)
    victim = sorted(val.iterdir())[0]
    victim.unlink()
    (val / "ILSVRC2012_val_99999999.JPEG").write_bytes(b"not in the csv")
    report = sort_into_classes(val, solutions)
    assert report.missing == [victim.stem] and report.not_in_solutions == 1 and report.moved == 5
    done = run_cli("data", "imagenet-val", str(val), "--solutions", str(solutions), "-o", "json", check=False)
    assert done.returncode == 1 and json.loads(done.stdout)["missing_images"] == [victim.stem]


@pytest.mark.parametrize(("csv", "message"), [
    ("Id,Label\nx,n01440764 1 2 3 4\n", "line 1 must be the header ImageId,PredictionString"),
    ("ImageId,PredictionString\nILSVRC2012_val_00000001,cat 1 2 3 4\n", "line 2: .* is not ImageId,<synset like n01751748>"),
    ("ImageId,PredictionString\n../../etc/passwd,n01440764 1 2 3 4\n", "line 2: .* is not ImageId"),
    ("ImageId,PredictionString\nA,n01440764 1\nA,n01443537 1\n", "line 3: A is listed twice with different classes"),
])
def test_a_bad_solutions_file_is_refused_naming_the_line_and_nothing_moves(tmp_path: Path, csv: str, message: str) -> None:
    val, _ = make_imagenet_val(tmp_path, classes=2, per_class=2, empty=True)
    bad = tmp_path / "bad.csv"
    bad.write_text(csv)
    before = layout(val)
    with pytest.raises(ConfigError, match=message):
        sort_into_classes(val, bad)
    assert layout(val) == before


def test_an_image_folder_without_class_folders_says_what_to_run(tmp_path: Path) -> None:
    val, _ = make_imagenet_val(tmp_path, classes=2, per_class=2)
    with pytest.raises(ConfigError, match="no images in class folders .*run unbroken data imagenet-val first"):
        ImageFolder(val, 32, train=True)
