"""One rank in full (Enter on the rank table): where it runs, why it stands out, its latest step
figures against the ranks' median, its memory, heartbeat and last step's lanes."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Static

from tui import format as fmt
from tui.outliers import Outliers
from tui.rank_order import node_of
from tui.state import RankState, RunState
from tui.timeline import LANES, busy_share, lanes_with_other, step_duration

MEMORY_PARTS = (("model states", "model_states"), ("parameters", "parameters"),
                ("gradients", "gradients"), ("optimizer state", "optimizer_state"),
                ("process RSS", "process_rss"), ("device allocated", "device_allocated"))


def detail_text(state: RunState, rank: RankState, found: Outliers) -> Text:
    """The rank's page, a fact a line."""
    record: dict[str, Any] = rank.step or {}
    status = found.statuses.get(rank.rank, rank.status(state.now, state.ended))
    kind = found.kind(rank.rank)
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"rank {rank.rank}", style="bold")
    text.append(f" on node {node_of(rank)}: {status}")
    if kind is not None:
        text.append(f"  outlier: {kind}", style="bold red")
    text.append("\n")
    if rank.stuck_reason:
        text.append(f"declared stuck: {rank.stuck_reason}\n", style="red")
    if rank.exit_code is not None:
        text.append(f"process exit code {rank.exit_code}\n")
    step_s = fmt.number(record.get("step_s"))
    median = found.median_step_s
    versus = f" ({step_s / median:.2f}x the median {fmt.seconds(median)})" \
        if step_s is not None and median else ""
    text.append(f"\nstep {record.get('step', fmt.MISSING)}  step time {fmt.seconds(step_s)}"
                f"{versus}\n")
    text.append(f"  forward {fmt.seconds(record.get('forward_s'))}  backward "
                f"{fmt.seconds(record.get('backward_s'))}  comm {fmt.seconds(record.get('comm_s'))}"
                f"  optimizer {fmt.seconds(record.get('optimizer_s'))}\n")
    text.append(f"  loss {fmt.loss(record.get('loss'))}  lr {record.get('lr', fmt.MISSING)}  "
                f"grad norm {fmt.loss(record.get('grad_norm'))}  loss scale "
                f"{fmt.scale(record.get('loss_scale'))}  skipped {record.get('skipped', 0)}\n")
    text.append(f"  samples/s {fmt.rate(record.get('samples_per_s'))}  overlap "
                f"{fmt.share(record.get('overlap'))}  comm share "
                f"{fmt.share(record.get('comm_share'))}  FLOPs util "
                f"{fmt.share(record.get('mfu'))}\n")
    found_mem = record.get("mem")
    mem: dict[str, Any] = found_mem if isinstance(found_mem, dict) else {}
    text.append("\nmemory: " + "  ".join(f"{label} {fmt.size(mem.get(key))}"
                                         for label, key in MEMORY_PARTS) + "\n")
    beat = rank.heartbeat or {}
    text.append(f"heartbeat: {beat.get('status', fmt.MISSING)}, busy in "
                f"{beat.get('busy_actor') or 'nothing'}, pending "
                f"{beat.get('pending_collective') or 'nothing'}, last heard "
                f"{fmt.age(rank.age(state.now))} ago\n")
    if rank.spans:
        duration = step_duration(rank)
        shares = ", ".join(
            f"{name} {busy_share(rank.spans, index, duration) * 100:.0f}%"
            for index, (name, _, _, _) in enumerate(lanes_with_other())
            if index < len(LANES) or busy_share(rank.spans, index, duration) > 0)
        text.append(f"\nlast spans (step {rank.spans_step}, {len(rank.spans)} spans, "
                    f"{fmt.seconds(duration)}): {shares}\n")
    text.append("\nescape or enter: back", style="dim")
    return text


class RankDetail(Screen[None]):
    """The detail page in place of the monitor's (a modal page over it drew the dimmed plots
    beneath at every refresh, a tenth of a second at 1,024 ranks); the app refreshes it with
    every redraw."""

    DEFAULT_CSS = """
    RankDetail > VerticalScroll {
        border: thick $accent;
        background: $panel;
        padding: 0 1;
    }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,enter,q", "dismiss", "back"),
    ]

    def __init__(self, rank: int, state: RunState, found: Outliers) -> None:
        super().__init__()
        self.rank = rank
        # written before the first frame, so that the page opens with its figures
        self.text = detail_text(state, state.ranks[rank], found)

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(self.text, id="rank-detail")

    def show(self, state: RunState, found: Outliers) -> None:
        rank = state.ranks.get(self.rank)
        if rank is None:
            return
        text = detail_text(state, rank, found)
        if text.plain != self.text.plain:
            self.text = text
            self.query_one("#rank-detail", Static).update(text)
