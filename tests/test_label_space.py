"""Labels mean what the plan says: a silo maps its files' classes into the plan's label space by name.

The walkthrough's cases: an image folder whose `9/` became `10/` (text order puts it between `1/` and `2/`, so
position would shift every digit 2-9 onto the next class), folders named `pneumonia/` and `normal/` against a
plan that lists them the other way, an npz whose `classes` array has its own order, and a silo that holds no
sample of a class (the normal case under a long tail), which must take part, not be refused every round.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from PIL import Image

from fedlt.config import read_toml, render_toml
from fedlt.data.files import load_image_folder, load_npz
from fedlt.errors import DataError
from silo.admission import RefusedRound
from tests.consortium_harness import PLAN, write_kit
from tests.test_silo_refusals import agent_of, check, signed_spec

DIGITS = tuple(str(d) for d in range(10))


def shade(label: int) -> int:
    """Each class's images have their own grey level, so a test can tell which class an image came from."""
    return 20 * label + 5


def image_folder(root, names: list[str]) -> None:
    for index, name in enumerate(names):
        (root / name).mkdir(parents=True)
        for k in range(2):
            pixels = np.full((8, 8), shade(index), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{k}.png")


def labels_by_shade(data) -> dict[int, int]:
    """The label each grey level got."""
    levels = np.rint(data.x[:, 0, 0, 0] * 255).astype(int)
    return {int(level): int(label) for level, label in zip(levels, data.y, strict=True)}


def test_a_renamed_class_folder_is_refused_by_name_where_position_would_mislabel_every_digit(tmp_path):
    names = [*DIGITS[:9], "10"]  # 9/ renamed 10/
    image_folder(tmp_path, names)
    data = load_image_folder(tmp_path)
    assert data.classes[:3] == ("0", "1", "10")  # text order: by position, 10 -> "2", 2 -> "3", ...
    assert data.num_classes == len(DIGITS)  # what the old check compared, and passed
    with pytest.raises(DataError, match=r"classes \['10'\] that the plan does not name") as refused:
        data.in_label_space(DIGITS)
    assert "'9'" in str(refused.value)  # the plan's names are listed beside the unknown one


def test_named_folders_in_another_order_than_the_plan_keep_their_labels(tmp_path):
    image_folder(tmp_path, ["pneumonia", "normal"])  # created in this order; shade 0 is pneumonia
    data = load_image_folder(tmp_path).in_label_space(("pneumonia", "normal")[::-1])
    assert data.classes == ("normal", "pneumonia")
    assert labels_by_shade(data) == {shade(0): 1, shade(1): 0}


def test_an_npz_classes_array_in_its_own_order_is_matched_by_name(tmp_path):
    x = np.stack([np.full((8, 8), shade(k), dtype=np.uint8) for k in (0, 1, 2)])
    path = tmp_path / "data.npz"
    np.savez(path, x=x, y=np.array([0, 1, 2]), classes=np.array(["c", "a", "b"]))
    data = load_npz(path).in_label_space(("a", "b", "c"))
    assert labels_by_shade(data) == {shade(0): 2, shade(1): 0, shade(2): 1}


def test_a_silo_lacking_classes_gets_the_plans_label_space_with_empty_classes(tmp_path):
    path = tmp_path / "data.npz"
    y = np.array([0, 3, 8, 8])  # no 9s: the file's own names stop at "8"
    np.savez(path, x=np.zeros((4, 8, 8), dtype=np.uint8), y=y)
    data = load_npz(path).in_label_space(DIGITS)
    assert data.num_classes == 10
    assert data.class_counts().tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 2, 0]


def test_bare_integer_labels_against_a_plan_of_names_say_how_to_name_them(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((2, 8, 8), dtype=np.uint8), y=np.array([0, 1]))
    with pytest.raises(DataError, match="integer labels named '0', '1'"):
        load_npz(path).in_label_space(("normal", "pneumonia"))


@pytest.fixture
def kit(tmp_path):
    return tmp_path, write_kit(tmp_path)


def use_files(kit, path) -> None:
    _, configs = kit
    tree = read_toml(configs[0])
    tree["data"] = {"source": "files", "path": str(path), "format": "npz"}
    configs[0].write_text(render_toml(tree))


def test_an_agent_without_a_class_takes_part_in_the_plans_label_space(kit):
    """Item 3 of issue 31: this silo was refused every RoundSpec (9 classes inferred, 10 planned)."""
    root, _ = kit
    path = root / "no-nines.npz"
    np.savez(path, x=np.zeros((6, 8, 8), dtype=np.uint8), y=np.array([0, 1, 2, 3, 4, 8]))
    use_files(kit, path)
    agent = agent_of(kit)
    admitted = check(agent, signed_spec(root))
    assert admitted.plan.model.classes == DIGITS
    assert admitted.data.class_counts().tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 1, 0]


def test_an_agent_with_a_class_the_plan_does_not_name_refuses_the_round_saying_which(kit):
    root, _ = kit
    path = root / "renamed.npz"
    classes = np.array([*DIGITS[:9], "10"])
    np.savez(path, x=np.zeros((10, 8, 8), dtype=np.uint8), y=np.arange(10), classes=classes)
    use_files(kit, path)
    agent = agent_of(kit)
    with pytest.raises(RefusedRound, match=r"classes \['10'\] that the plan does not name"):
        check(agent, signed_spec(root))


def test_a_plan_naming_a_class_twice_is_refused(kit):
    root, _ = kit
    plan = PLAN.to_toml().replace('classes = ["0", "1"', 'classes = ["1", "1"')
    assert plan != PLAN.to_toml()
    signed = signed_spec(root, method_config=plan, config_sha256=hashlib.sha256(plan.encode()).hexdigest())
    with pytest.raises(RefusedRound, match=r"model.classes: names \['1'\] more than once"):
        check(agent_of(kit), signed)


def test_whether_a_silo_refuses_says_nothing_of_which_classes_it_holds(tmp_path):
    """Found in review: a plan leaving out one class at a time asked each silo "do you hold this class?", as
    the refusal went by the samples held. It goes by the classes the files name, held or not."""
    names = np.array(DIGITS)
    outcomes = []
    for k, labels in enumerate(([0, 1, 8], [0, 1, 2])):  # the first holds an 8, the second none
        path = tmp_path / f"silo-{k}.npz"
        np.savez(path, x=np.zeros((3, 8, 8), dtype=np.uint8), y=np.array(labels), classes=names)
        data = load_npz(path)
        for left_out in DIGITS:
            try:
                data.in_label_space(tuple(c for c in DIGITS if c != left_out))
                outcomes.append((k, left_out, "took part"))
            except DataError:
                outcomes.append((k, left_out, "refused"))
    assert {(left_out, outcome) for _, left_out, outcome in outcomes} == {(c, "refused") for c in DIGITS}
