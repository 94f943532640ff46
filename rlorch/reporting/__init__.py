"""What the operator sees: start-up phases, the live progress view and the end-of-run report
(``progress``), and ``rlorch report``'s pictures and ``report.md`` (``report``)."""
