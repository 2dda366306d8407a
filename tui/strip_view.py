"""A scrollable widget that draws prebuilt lines (Strips), for the monitor's big, fast-changing
parts: building a row once when its figures change and cropping it per frame costs far less
than laying out styled text for every cell on every redraw (64 ranks at 10 Hz); past that, a
view may build only the lines on screen (``line_at``)."""

from __future__ import annotations

from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip


@lru_cache(maxsize=256)
def style(text: str) -> Style:
    """A parsed Rich style, cached: the same few styles are used on every line."""
    return Style.parse(text) if text else Style()


def line(*parts: tuple[str, str]) -> Strip:
    """A Strip from ``(text, style)`` pieces."""
    return Strip([Segment(text, style(spec)) for text, spec in parts if text])


class StripView(ScrollView):
    """Shows ``lines`` with the first ``fixed_top`` of them pinned while the rest scroll."""

    # Arrow keys pick ranks in the monitor; these views scroll to follow, or with the wheel.
    can_focus = False

    DEFAULT_CSS = """
    StripView {
        height: 1fr;
    }
    """

    def __init__(self, fixed_top: int = 0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.fixed_top = fixed_top
        self.lines: list[Strip] = []

    def set_lines(self, lines: list[Strip]) -> None:
        self.lines = lines
        self.set_extent(max((strip.cell_length for strip in lines), default=0), len(lines))

    def set_extent(self, width: int, count: int) -> None:
        """The size of what there is to scroll over; redraws the visible lines."""
        size = Size(width, count)
        if size != self.virtual_size:
            # A new virtual size lays out the whole screen again: only when it changes.
            self.virtual_size = size
        self.refresh()

    def line_at(self, index: int) -> Strip | None:
        """Line ``index``; a view that builds its lines only when they are on screen (1,024
        rank rows, of which 40 show) overrides this and ``set_extent``s instead of setting
        ``lines``."""
        return self.lines[index] if index < len(self.lines) else None

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        index = y if y < self.fixed_top else y + scroll_y
        width = self.size.width
        found = self.line_at(index)
        if found is None:
            return Strip.blank(width, self.rich_style)
        return found.crop_extend(scroll_x, scroll_x + width, self.rich_style)

    def show_line(self, index: int) -> None:
        """Scrolls so that line ``index`` is visible below the pinned lines."""
        visible = max(1, self.size.height - self.fixed_top)
        top = self.scroll_offset.y
        row = index - self.fixed_top
        if row < top:
            self.scroll_to(y=row, animate=False)
        elif row >= top + visible:
            self.scroll_to(y=row - visible + 1, animate=False)
