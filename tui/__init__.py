"""The Textual monitor of a live or finished run (``flowtrain monitor``).

``tui.state`` models the run from telemetry records, ``tui.source`` feeds it (replay or live),
``tui.app`` draws it; each screen part has its own module (header, rank table, plots, timeline,
event log). Nothing here imports Textual until the app module is imported.
"""
