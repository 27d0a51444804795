"""``rlaunch report``: one self-contained HTML page (and CSV files) that show what a job went through.

- :mod:`.source` reads the job's events, from etcd or from ``events.jsonl`` files;
- :mod:`.timeline` turns them into a timeline (pure: generations, node states over time,
  incidents with their downtime, step-time and goodput points);
- :mod:`.export` writes the timeline as CSV files a BI tool can load;
- :mod:`.render` draws it with plotly into one HTML file that needs no network to view.
"""

from __future__ import annotations

from rlaunch.errors import RlaunchError


class ReportError(RlaunchError):
    """The report cannot be made: its events are missing, unreadable or not a job's."""
