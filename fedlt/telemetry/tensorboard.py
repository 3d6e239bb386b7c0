"""Round metrics as TensorBoard event files (`tensorboard --logdir <folder>`), written by the `tensorboard`
package's own writer through torch's `SummaryWriter`.

A run that starts again reads the folder's event files, as TensorBoard does, for the last step they hold,
and opens another event file whose first event marks a restart at the first step it will write
(`purge_step`); TensorBoard's reader then drops what earlier files hold at that step or later. So each
round is shown once, whichever came first: a round a killed process wrote but never kept (the simulator
writes a round before its checkpoint) is written again, and a round it kept but never wrote (the
aggregator keeps a round's metrics in its store first) is written from the run's history.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

EVENT_FILES = "events.out.tfevents.*"


class TensorBoardSink:
    """`history`: the steps a run recorded before this start, in order, each with a maker of its scalars
    (`fedlt.telemetry.Past`); those the folder's event
    files lack are written first (all of them to a folder without event files: a run that had none, an
    aggregator that had no TensorBoard yet). The last step the files hold is written again from the
    history, in case a killed writer left only part of it."""

    def __init__(
        self, folder: Path, *, history: Sequence[tuple[int, Callable[[], Mapping[str, float]]]]
    ) -> None:
        self.folder = folder
        written = last_step(folder)
        after = max((step for step, _ in history), default=-1)
        first = 0 if written < 0 else min(written, after + 1)
        from torch.utils.tensorboard import SummaryWriter  # loads tensorboard only where a run writes

        self._writer = SummaryWriter(str(folder), purge_step=first)
        for step, values in history:
            if step >= first:
                self._add(step, values())
        self._writer.flush()

    def write(self, step: int, values: Mapping[str, float]) -> None:
        self._add(step, values)
        self._writer.flush()  # on disk with the round: a killed process loses none that metrics.json holds

    def close(self) -> None:
        self._writer.close()

    def _add(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)

    def __str__(self) -> str:
        return f"the TensorBoard event files in {self.folder}"


def last_step(folder: Path) -> int:
    """The last step of any scalar the folder's event files hold, as TensorBoard reads them (-1: none)."""
    if not any(folder.glob(EVENT_FILES)):
        return -1
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={SCALARS: 0})  # 0: keep every step
    events.Reload()
    steps = (event.step for tag in events.Tags()["scalars"] for event in events.Scalars(tag))
    return max(steps, default=-1)
