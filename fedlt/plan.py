"""What every silo runs in a round — model, local training, method, how silos are picked — as one TOML
document.

The aggregator writes it into the signed RoundSpec; a silo parses it with the same validation as any config
and builds exactly the method the simulator would build, which is what makes a consortium run and a
simulator run of the same settings produce the same model.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from fedlt.aggregation import Schema, evaluation_block
from fedlt.config import as_table, as_toml, parse_section, setting
from fedlt.data.images import ImageSettings
from fedlt.data.source import Wanted
from fedlt.data.table import TableSchema
from fedlt.dp import DPSettings
from fedlt.errors import ConfigError
from fedlt.methods import Method, MethodChoice, ModelSpec, TrainConfig, method_class
from fedlt.models import MODELS, ModelOptions
from fedlt.models.entry import ENTRY_FORM, parse_entry
from fedlt.selection import SelectionConfig


@dataclass(frozen=True)
class ModelSection:
    """A built-in model, or one named by entry point with its factory's `options` (`fedlt.models.entry`;
    each silo runs only entry points its policy pins, `silo.models`)."""

    name: str = setting("cnn", doc=f"{', '.join(MODELS)}, or an entry point {ENTRY_FORM}")
    image_shape: tuple[int, ...] = (1, 28, 28)
    classes: tuple[str, ...] = tuple(str(d) for d in range(10))
    options: ModelOptions = field(default_factory=ModelOptions)

    def problems(self) -> list[str]:
        """The name's form and the options it may take; nothing is imported here."""
        if self.name in MODELS:
            return [f"model.options: the built-in model {self.name} takes no options"] if self.options else []
        if parse_entry(self.name) is None:
            allowed = f"{', '.join(map(repr, MODELS))}, or an entry point {ENTRY_FORM}"
            return [f"model.name: unknown model {self.name!r}; allowed: {allowed}"]
        return []

    def to_table(self) -> dict[str, Any]:
        """As a plan writes it; without options, exactly as before entry points, so that a built-in plan's
        text and hash stay the same."""
        table: dict[str, Any] = {"name": self.name, "image_shape": self.image_shape, "classes": self.classes}
        if self.options:
            table["options"] = self.options.to_table()
        return table


@dataclass(frozen=True)
class DataPlan:
    """What every silo's data must look like, signed with the plan so that every silo prepares its own files
    the same way (`fedlt.data.source`): rows of a `table` schema, or images prepared per `images` to the
    model's `image_shape`."""

    table: TableSchema | None = None
    images: ImageSettings = field(default_factory=ImageSettings)

    def problems(self, image_shape: tuple[int, ...]) -> list[str]:
        """The table's schema, or the image settings against the model's `image_shape`."""
        return self.images.problems(image_shape) if self.table is None else self.table.problems()

    def to_table(self) -> dict[str, Any]:
        """Only what differs from images as they are: a plan without a `[data]` section reads and hashes
        as before it had one."""
        table: dict[str, Any] = {} if self.table is None else {"table": self.table.to_table()}
        if self.images != ImageSettings():
            table["images"] = as_table(self.images)
        return table


@dataclass(frozen=True)
class EvaluationPlan:
    """Whether silos add held-out evaluation counts to every round's sum (`aggregation.evaluation_block`),
    signed with the plan so that each silo knows to; a consortium sets it from its `[evaluation]` section."""

    held_out: bool = setting(False, doc="silos evaluate each state on their held-out data, inside the sum")


@dataclass(frozen=True)
class RoundPlan:
    """`rounds` is the planned number of training rounds; a consortium sets it from `[consortium] rounds`."""

    rounds: int = setting(20, ge=1)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    method: MethodChoice = field(default_factory=MethodChoice)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    dp: DPSettings = field(default_factory=DPSettings)
    evaluation: EvaluationPlan = field(default_factory=EvaluationPlan)
    data: DataPlan = field(default_factory=DataPlan)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One sample's shape: the encoded features of a table row, else `[model] image_shape`."""
        if self.data.table is not None:
            return (len(self.data.table.layout().features),)
        return self.model.image_shape

    def wanted(self) -> Wanted:
        """What every silo's data must be prepared into for this plan (`fedlt.data.source`)."""
        return Wanted(self.data.table, self.data.images, self.input_shape, self.model.classes)

    def problems(self) -> list[str]:
        """What the field-by-field checks cannot see."""
        problems = self.selection.problems() + self.dp.problems(discloses=self.selection.discloses)
        problems += self.model.problems() + self.data.problems(self.model.image_shape)
        shape = self.model.image_shape
        if len(shape) != 3 or min(shape, default=0) < 1:
            problems.append(f"model.image_shape: expected [channels, height, width], got {list(shape)}")
        classes = self.model.classes
        repeated = sorted({name for name in classes if classes.count(name) > 1})
        if repeated or not classes:
            problems.append(
                f"model.classes: names {repeated} more than once" if repeated else "model.classes: empty"
            )
        unprintable = [name for name in classes if not name.isprintable() or not name.strip()]
        if unprintable:
            problems.append(f"model.classes: {unprintable} are not printable names (model cards show them)")
        return problems

    def build_method(self) -> Method:
        table = None if self.data.table is None else self.data.table.layout()
        spec = ModelSpec(
            self.model.name,
            self.input_shape,
            len(self.model.classes),
            options=self.model.options,
            table=table,
        )
        return method_class(self.method.name)(
            options=self.method.options, train=self.train, model=spec, rounds=self.rounds, dp=self.dp
        )

    def round_schema(self, schema: Schema, *, starting_round: int, remaining: int) -> Schema:
        """What a round from a state sums, as both ends derive it (the aggregator signs it, each silo checks
        it): the method's `schema` for the state and, with held-out evaluation, the evaluation block; a
        state with no `remaining` rounds gets the evaluation-only round."""
        if not self.evaluation.held_out:
            return schema
        return evaluation_block.round_schema(
            None if remaining == 0 else schema, len(self.model.classes), first=starting_round == 0
        )

    def to_table(self) -> dict[str, Any]:
        """As written, without an empty `[data]` (a plan of images as they are hashes as it always did), and
        without `[model] image_shape` in a study of table rows."""
        table = {f.name: getattr(self, f.name) for f in fields(self)}
        table = {k: as_table(v) if is_dataclass(v) else v for k, v in table.items()}
        if self.data.table is not None:  # rows have no image shape: the schema gives the input
            del table["model"]["image_shape"]
        return {k: v for k, v in table.items() if not (k == "data" and not v)}

    def to_toml(self) -> str:
        return as_toml(self)

    def sha256(self) -> str:
        return hashlib.sha256(self.to_toml().encode()).hexdigest()

    @classmethod
    def from_toml(cls, text: str, source: str) -> RoundPlan:
        try:
            tree = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(source, [f"not valid TOML: {exc}"]) from None
        problems: list[str] = []
        plan = parse_section(cls, tree, "", problems)
        problems += plan.problems()
        if problems:
            raise ConfigError(source, problems)
        return plan
