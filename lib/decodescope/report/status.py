"""The colour each run or phase status is shown in, shared by the report's header and the index of runs."""

STATUS_COLOURS = {"ok": "#1a7f37", "failed": "#cf222e", "skipped": "#9a6700", "pending": "#57606a",
                  "running": "#0969da"}
UNKNOWN_COLOUR = "#57606a"


def status_colour(status: str) -> str:
    return STATUS_COLOURS.get(status, UNKNOWN_COLOUR)
