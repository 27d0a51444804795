"""A timeline drawn as one self-contained HTML page (plotly, with plotly.js inlined: no network to view).

The page has a header of summary figures, the timeline (a row per node, coloured by state, with
generation lines, incidents shaded and labelled with their downtime, findings marked), the plot of
step time and goodput over time, and tables of the incidents and generations.
"""

from __future__ import annotations

import datetime
import html
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from rlaunch import __version__
from rlaunch.report.timeline import Incident, Timeline

#: Colour of each node state on the timeline.
STATE_COLOURS = {
    "waiting": "#cfd8dc",
    "warming": "#90caf9",
    "standby": "#1e88e5",
    "restarting": "#ffb300",
    "running": "#43a047",
    "draining": "#8e24aa",
    "drained": "#9e9e9e",
    "succeeded": "#1b5e20",
    "failed": "#e53935",
    "stopping": "#616161",
}
INCIDENT_COLOURS = {"drain": "#8e24aa", "migration": "#5e35b1", "recovery": "#e53935", "restart": "#fb8c00"}
#: Node colours for the step-time and goodput lines.
NODE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
CONFIG = {"displaylogo": False, "responsive": True}


def when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: float | None) -> str:
    """A duration for people: 24 ms, 9.58 s, 3 min 20 s, 2 h 05 min."""
    if seconds is None:
        return "n/a"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.2f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def incident_label(i: Incident) -> str:
    return f"{i.kind} g{i.generation}: {duration(i.downtime_s)}"


def timeline_figure(tl: Timeline) -> go.Figure:
    """A row per node, coloured by state; generation lines; incidents shaded; findings marked."""
    t0, nodes = tl.start, tl.nodes
    fig = go.Figure()
    for state, colour in STATE_COLOURS.items():
        segs = [s for s in tl.segments if s.state == state]
        if not segs:
            continue
        fig.add_trace(
            go.Bar(
                name=state, orientation="h", y=[s.node for s in segs], base=[s.start - t0 for s in segs],
                x=[max(s.end - s.start, 1e-3) for s in segs], marker={"color": colour, "line": {"width": 0}},
                customdata=[[s.role, s.generation, duration(s.end - s.start), round(s.start - t0, 2),
                             round(s.end - t0, 2)] for s in segs],
                hovertemplate="node %{y}: <b>" + state + "</b> (%{customdata[0]}), generation %{customdata[1]}"
                "<br>%{customdata[3]} s → %{customdata[4]} s (%{customdata[2]})<extra></extra>",
            )
        )  # fmt: skip
    if tl.findings:
        fig.add_trace(
            go.Scatter(
                name="finding", mode="markers", x=[f.time - t0 for f in tl.findings], y=[f.node for f in tl.findings],
                marker={"symbol": "x", "size": 13, "color": "#b71c1c", "line": {"width": 2, "color": "white"}},
                text=[f"{f.label} (generation {f.generation})" for f in tl.findings],
                hovertemplate="%{y}: %{text} at %{x:.2f} s<extra></extra>",
            )
        )  # fmt: skip
    _mark_generations(fig, tl)
    _shade_incidents(fig, tl, label=True)
    fig.update_layout(
        barmode="overlay", height=200 + 46 * len(nodes), margin={"l": 60, "r": 20, "t": 90, "b": 50},
        legend={"orientation": "h", "y": -0.25 if len(nodes) < 4 else -0.12, "title": {"text": "state "}},
        xaxis={"title": {"text": f"seconds since {when(t0)}"}, "range": _x_range(tl), "zeroline": False},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(nodes)), "title": {"text": "node"}},
        plot_bgcolor="#fafafa", bargap=0.35,
    )  # fmt: skip
    return fig


def steps_figure(tl: Timeline) -> go.Figure:
    """Step time (ms) and goodput (%) over time, a line per node; each migration's step as a diamond."""
    t0 = tl.start
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
        subplot_titles=("Step time (median of the node's ranks)", "Goodput (time in applied steps / wall time)"),
    )  # fmt: skip
    usual = usual_interval(tl)
    for n, node in enumerate(tl.nodes):
        colour = NODE_COLOURS[n % len(NODE_COLOURS)]
        prog = [p for p in tl.points if p.node == node and p.source == "progress"]
        if prog:
            xs, ys = gapped([p.time - t0 for p in prog], [p.step_s * 1000 for p in prog], usual)
            custom: list[list[int | None]] = [[p.generation, p.steps, p.applied] for p in prog]
            for k, x in enumerate(xs):
                if x is None:
                    custom.insert(k, [None, None, None])
            fig.add_trace(
                go.Scatter(
                    name=f"{node}", legendgroup=node, mode="lines+markers", x=xs,
                    y=ys, line={"color": colour}, marker={"size": 5}, customdata=custom,
                    hovertemplate=f"{node}: %{{y:.1f}} ms per step at %{{x:.1f}} s<br>generation %{{customdata[0]}}, "
                    "%{customdata[1]} steps since the last sample, last applied step %{customdata[2]}<extra></extra>",
                ),
                row=1, col=1,
            )  # fmt: skip
            good = [p for p in prog if p.goodput is not None]
            xs, ys = gapped([p.time - t0 for p in good], [(p.goodput or 0.0) * 100 for p in good], usual)
            fig.add_trace(
                go.Scatter(
                    name=f"{node} goodput", legendgroup=node, showlegend=False, mode="lines+markers", x=xs, y=ys,
                    line={"color": colour}, marker={"size": 5},
                    hovertemplate=f"{node}: goodput %{{y:.1f}} % at %{{x:.1f}} s<extra></extra>",
                ),
                row=2, col=1,
            )  # fmt: skip
        switched = [p for p in tl.points if p.node == node and p.source == "switched"]
        if switched:
            fig.add_trace(
                go.Scatter(
                    name=f"{node}: step with a switch", legendgroup=node, mode="markers",
                    x=[p.time - t0 for p in switched], y=[p.step_s * 1000 for p in switched],
                    marker={"symbol": "diamond", "size": 11, "color": colour, "line": {"width": 1, "color": "black"}},
                    hovertemplate=f"{node}: the step with the switch took %{{y:.1f}} ms (generation "
                    "%{text})<extra></extra>", text=[str(p.generation) for p in switched],
                ),
                row=1, col=1,
            )  # fmt: skip
    _shade_incidents(fig, tl, label=False)
    fig.update_yaxes(title_text="ms per step", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="goodput %", range=[0, 105], row=2, col=1)
    fig.update_xaxes(range=_x_range(tl), row=1, col=1)
    fig.update_xaxes(title_text=f"seconds since {when(t0)}", range=_x_range(tl), row=2, col=1)
    fig.update_layout(
        height=560, margin={"l": 60, "r": 20, "t": 50, "b": 50}, plot_bgcolor="#fafafa",
        legend={"orientation": "h", "y": -0.14, "title": {"text": "node "}}, hovermode="closest",
    )  # fmt: skip
    return fig


def usual_interval(tl: Timeline) -> float:
    """The median time between two progress samples of one node (0 if unknown)."""
    gaps: list[float] = []
    for node in tl.nodes:
        times = [p.time for p in tl.points if p.node == node and p.source == "progress"]
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    return sorted(gaps)[len(gaps) // 2] if gaps else 0.0


def gapped(xs: list[float], ys: list[float], usual: float) -> tuple[list[float | None], list[float | None]]:
    """The points with a break (None) where the reports stopped for a while (more than 2.5 times the
    ``usual`` interval: a recovery, a restart), so that no line is drawn across the outage."""
    out_x: list[float | None] = []
    out_y: list[float | None] = []
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if i and usual > 0 and x - xs[i - 1] > 2.5 * usual:
            out_x.append(None)
            out_y.append(None)
        out_x.append(x)
        out_y.append(y)
    return out_x, out_y


def _x_range(tl: Timeline) -> list[float]:
    span = max(tl.end - tl.start, 1.0)
    return [-0.01 * span, span * 1.01]


def _mark_generations(fig: go.Figure, tl: Timeline) -> None:
    for n, g in enumerate(tl.generations):
        fig.add_vline(x=g.time - tl.start, line={"dash": "dot", "color": "#455a64", "width": 1})
        fig.add_annotation(
            x=g.time - tl.start, y=1.0, yref="paper", yanchor="bottom", showarrow=False, textangle=0,
            yshift=14 * (n % 2), xanchor="left" if n == 0 else "center",
            text=f"g{g.number} {g.plan}", font={"size": 10, "color": "#455a64"}, hovertext=html.escape(g.reason),
        )  # fmt: skip


def _shade_incidents(fig: go.Figure, tl: Timeline, label: bool) -> None:
    """Each incident as a shaded band (at least 0.6 % of the axis wide, so a 20 ms one shows)."""
    floor = 0.006 * max(tl.end - tl.start, 1.0)
    for n, i in enumerate(tl.incidents):
        colour = INCIDENT_COLOURS.get(i.kind, "#757575")
        x0, x1 = i.start - tl.start, i.end - tl.start
        if x1 - x0 < floor:
            x0, x1 = (x0 + x1 - floor) / 2, (x0 + x1 + floor) / 2
        fig.add_vrect(x0=x0, x1=x1, fillcolor=colour, opacity=0.18, line_width=0, layer="below")
        if label:
            fig.add_annotation(
                x=(x0 + x1) / 2, y=1.0, yshift=32 + 16 * (n % 2), yref="paper", yanchor="bottom", showarrow=False,
                text=f"<b>{html.escape(incident_label(i))}</b>", font={"size": 11, "color": colour},
                hovertext=html.escape(i.detail), bgcolor="rgba(255,255,255,0.85)",
            )  # fmt: skip


def _cards(tl: Timeline) -> str:
    s = tl.summary()
    goodput = "n/a" if s["goodput"] is None else f"{s['goodput'] * 100:.1f} %"
    step = "n/a" if s["median_step_s"] is None else f"{s['median_step_s'] * 1000:.1f} ms"
    cards: list[tuple[str, Any]] = [
        ("outcome", s["outcome"]), ("wall time", duration(s["wall_s"])), ("nodes", s["nodes"]),
        ("generations", s["generations"]), ("drains", s["drains"]), ("straggler moves", s["migrations"]),
        ("recoveries", s["recoveries"]), ("restarts", s["restarts"]), ("findings", s["findings"]),
        ("total downtime", duration(s["downtime_s"])), ("median downtime", duration(s["median_downtime_s"])),
        ("median step", step), ("goodput (last)", goodput),
    ]  # fmt: skip
    return "".join(
        f'<div class="card"><div class="v">{html.escape(str(v))}</div><div class="k">{html.escape(k)}</div></div>'
        for k, v in cards
    )


def _table(header: list[str], rows: list[list[Any]], cls: str) -> str:
    if not rows:
        return '<p class="none">None.</p>'
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>rlaunch report: {job}</title>
<style>
body {{ font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 24px 32px; color: #212121; }}
h1 {{ font-size: 22px; margin: 0 0 4px; }} h2 {{ font-size: 17px; margin: 28px 0 6px; }}
.sub {{ color: #616161; font-size: 13px; }}
.cards {{ display: flex; flex-wrap: wrap; gap: 10px; margin: 16px 0; }}
.card {{ border: 1px solid #e0e0e0; border-radius: 6px; padding: 8px 14px; min-width: 96px; background: #fafafa; }}
.card .v {{ font-size: 19px; font-weight: 600; }} .card .k {{ font-size: 12px; color: #757575; }}
table {{ border-collapse: collapse; font-size: 13px; }} td, th {{ border-bottom: 1px solid #eee; padding: 4px 10px;
text-align: left; vertical-align: top; }} th {{ background: #f5f5f5; }}
.none {{ color: #757575; font-size: 13px; }}
</style></head>
<body>
<h1>rlaunch report: job {job}</h1>
<div class="sub">{span} · {count} events · made by rlaunch {version}{note}</div>
<div class="cards" id="rlaunch-summary">{cards}</div>
<div class="sub" id="rlaunch-live-moves">{moves}</div>
<h2>Timeline</h2>
<div class="sub">Each node's state over time; dotted lines mark generations; shaded bands are drains (purple),
straggler moves (indigo), recoveries (red) and restarts (orange), labelled with their downtime;
✕ marks a fault or finding.</div>
{timeline}
<h2>Step time and goodput</h2>
<div class="sub">From the progress samples each agent takes every 30 s while its ranks step (written in
batched <code>progress</code> events); diamonds are the step in which a migration switched ranks.</div>
{steps}
<h2>Incidents</h2>
{incidents}
<h2>Generations</h2>
{generations}
</body></html>
"""


def render_html(tl: Timeline, note: str = "") -> str:
    """The whole page, plotly.js included once (in the first figure)."""
    t0 = tl.start
    timeline = timeline_figure(tl).to_html(
        full_html=False, include_plotlyjs=True, div_id="rlaunch-timeline", config=CONFIG
    )
    if any(p.source == "progress" for p in tl.points) or any(p.source == "switched" for p in tl.points):
        steps = steps_figure(tl).to_html(full_html=False, include_plotlyjs=False, div_id="rlaunch-steps", config=CONFIG)
    else:
        steps = (
            '<p class="none" id="rlaunch-steps">No step times in these events: the job ran no step that the agents '
            "sampled (agents sample progress every 30 s while ranks step, with the rlaunch runtime).</p>"
        )
    incidents = _table(
        ["kind", "generation", "start (s)", "end (s)", "downtime", "measured by", "nodes", "what happened"],
        [[i.kind, i.generation, f"{i.start - t0:.2f}", f"{i.end - t0:.2f}", duration(i.downtime_s),
          "the workers" if i.measured else "the events", " ".join(i.nodes), i.detail] for i in tl.incidents],
        "incidents",
    )  # fmt: skip
    generations = _table(
        ["generation", "at (s)", "plan", "status", "restarts", "node ranks", "reason"],
        [[g.number, f"{g.time - t0:.2f}", g.plan, g.status, g.restart_count,
          ", ".join(f"{n}={r}" for n, r in sorted(g.assignment.items(), key=lambda x: x[1])), g.reason]
         for g in tl.generations],
        "generations",
    )  # fmt: skip
    return PAGE.format(
        job=html.escape(tl.job), span=f"{when(tl.start)} → {when(tl.end)}", count=len(tl.events),
        version=__version__, note=html.escape(note), cards=_cards(tl), timeline=timeline, steps=steps,
        incidents=incidents, generations=generations,
        moves=html.escape(f"Live moves: {tl.live_moves}" if tl.live_moves else "Live moves: not reported"),
    )  # fmt: skip
