"""The Textual monitor of a live or finished run (built by the telemetry issue)."""
