"""The run directory, the source of truth of a run: its layout and atomic writes (``layout``),
the batch file's two formats (``batchfile``), what ``orchestrator.json`` holds (``state``),
checkpoint validation before a resume touches anything (``validation``), what ``checkpoint=``
may name and when a run is finished (``targets``), and preparing a resume (``resume``)."""
