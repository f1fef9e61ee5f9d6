"""Summaries, tables and plots of the cold-start benchmark (benchmarks/coldstart.py).

Owns: turning the raw samples into medians, spreads and paired ratios (each round's Docker
sample over the same round's WeEnv sample, then the median), the checks against DESIGN.md's
budgets (cold time-to-ready 15x Docker or better; bytes fetched to get ready under 15% of the
image), the RL tax (the share of an iteration's wall time that is not the task itself), the
tables on stdout and the plots in docs/ (matplotlib, the `bench` extra of pyproject.toml).

Must not: run anything, or decide what is measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import print_table

DOCS = Path(__file__).resolve().parent.parent / "docs"
BUDGET_SPEEDUP = 15.0
BUDGET_FRACTION = 0.15
MB = 1e6


def _stats(values: Sequence[float]) -> dict[str, Any]:
    med = statistics.median(values)
    spread = (max(values) - min(values)) / med if med else 0.0
    return {"median": med, "spread": spread, "min": min(values), "max": max(values),
            "n": len(values)}


def _paired(mine: Sequence[float | None], theirs: Sequence[float | None]) -> float:
    """The median of per-round ratios, over the rounds where both have a number."""
    pairs = [a / b for a, b in zip(mine, theirs, strict=True)
             if a is not None and b is not None and b]
    return statistics.median(pairs) if pairs else float("nan")


def _ok(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [b for b in batches if "error" not in b]


def _per_round(batches: list[dict[str, Any]], key: str) -> list[float | None]:
    return [None if "error" in b else (b["moved"].get("bytes", 0) if key == "bytes"
                                       else b[key]) for b in batches]


def _ready_cell(all_batches: list[dict[str, Any]]) -> dict[str, Any]:
    batches = _ok(all_batches)
    failed = len(all_batches) - len(batches)
    if not batches:
        return {"failed": failed, "errors": [b["error"] for b in all_batches]}
    cell: dict[str, Any] = {
        "failed": failed,
        "all_ready_s": _stats([b["all_ready_s"] for b in batches]),
        "median_ready_s": _stats([b["median_ready_s"] for b in batches]),
        "median_started_s": _stats([b["median_started_s"] for b in batches]),
        "bytes": _stats([b["moved"].get("bytes", 0) for b in batches])}
    if all("link_bytes" in b["moved"] for b in batches):
        cell["link_bytes"] = _stats([b["moved"]["link_bytes"] for b in batches])
    return cell


def _ready_block(by_contender: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {name: _ready_cell(b) for name, b in by_contender.items()}
    docker = by_contender.get("docker")
    if docker:
        for name, batches in by_contender.items():
            if name != "docker" and "all_ready_s" in out[name]:
                out[name]["docker_over_this"] = _paired(
                    _per_round(docker, "all_ready_s"), _per_round(batches, "all_ready_s"))
                out[name]["bytes_over_docker"] = _paired(
                    _per_round(batches, "bytes"), _per_round(docker, "bytes"))
    return out


def _rl_block(by_contender: dict[str, list[dict[str, Any]]], ideal: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, all_batches in by_contender.items():
        batches = _ok(all_batches)
        if not batches:
            out[name] = {"failed": len(all_batches),
                         "errors": [b["error"] for b in all_batches]}
            continue
        walls = [b["wall_s"] for b in batches]
        env_share = []
        for b in batches:
            env = [e["started"] + (e["stopped"] - e["done"]) for e in b["envs"]]
            env_share.append(sum(env) / sum(e["stopped"] for e in b["envs"]))
        out[name] = {"wall_s": _stats(walls),
                     "tax_share": _stats([1 - ideal / w for w in walls]),
                     "setup_teardown_share": _stats(env_share),
                     "failed": len(all_batches) - len(batches)}
    return out


def _by_number(by_n: dict[str, Any]) -> list[tuple[str, Any]]:
    """Items keyed by N ('1', '8', '32'), in numeric order (the JSON sorts keys as text)."""
    return sorted(by_n.items(), key=lambda item: int(item[0]))


def summarize(results: dict[str, Any], image_bytes: Callable[[str], int]) -> dict[str, Any]:
    """Medians, spreads, ratios and budget checks of a run's results; `image_bytes(image)`
    is an image's size (its layer tars)."""
    summary: dict[str, Any] = {"ready": {}}
    for label, by_n in results["ready"].items():
        summary["ready"][label] = {n: {sc: _ready_block(c) for sc, c in by_sc.items()}
                                   for n, by_sc in _by_number(by_n)}
    if "reference" in results:
        summary["reference"] = {sc: _ready_block(c) for sc, c in results["reference"].items()}
    if results["update"]:
        runs = {name: _ok(rs) for name, rs in results["update"]["runs"].items()}
        runs = {name: rs for name, rs in runs.items() if rs}
        summary["update"] = {name: {"total_s": _stats([r["total_s"] for r in rs]),
                                    "bytes_uploaded": _stats([r["bytes_uploaded"] for r in rs])}
                             for name, rs in runs.items()}
        raw = results["update"]["runs"]
        if "docker" in runs and "weenv" in runs:
            summary["update"]["docker_over_weenv_time"] = _paired(
                _per_round(raw["docker"], "total_s"), _per_round(raw["weenv"], "total_s"))
            summary["update"]["docker_over_weenv_bytes"] = _paired(
                _per_round(raw["docker"], "bytes_uploaded"),
                _per_round(raw["weenv"], "bytes_uploaded"))
    if results["rl"]:
        rl = results["rl"]
        ideal = rl["think_s"] + min(rl["ideal_task_s"].values())
        summary["rl"] = {"ideal_s": ideal, "think_s": rl["think_s"], "by_k": {
            k: {sc: _rl_block(c, ideal) for sc, c in by_sc.items()}
            for k, by_sc in _by_number(rl["runs"])}}
    summary["budgets"] = _budgets(summary, image_bytes)
    return summary


def _budgets(summary: dict[str, Any], image_bytes: Callable[[str], int]) -> dict[str, Any]:
    """DESIGN.md's two cold-start budgets, on the reference tree when it ran, and on a task
    of the family (cold node, N = 1, servers on loopback)."""
    out = {}
    cases = [("task", summary["ready"].get("loopback", {}).get("1", {}).get("cold"), "task-1")]
    if "reference" in summary:
        cases.insert(0, ("reference", summary["reference"]["cold"], "reference"))
    for case, block, image in cases:
        if not block:
            continue
        size = image_bytes(image)
        entry: dict[str, Any] = {"image_bytes": size}
        for name, cell in block.items():
            if name == "docker" or "bytes" not in cell:
                continue
            fraction = cell["bytes"]["median"] / size
            entry[name] = {"bytes_fraction_of_image": fraction,
                           "bytes_within_budget": fraction < BUDGET_FRACTION}
            if "docker_over_this" in cell:
                speedup = cell["docker_over_this"]
                entry[name].update({"speedup": speedup,
                                    "speedup_within_budget": speedup >= BUDGET_SPEEDUP})
        out[case] = entry
    return out


# -- tables -------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> None:
    """Print the tables of a summarized run."""
    summary = results["summary"]
    rows = []
    for label, by_n in summary["ready"].items():
        for n, by_sc in by_n.items():
            for sc, block in by_sc.items():
                rows.extend(_ready_rows(f"{label}", n, sc, block))
    if "reference" in summary:
        for sc, block in summary["reference"].items():
            rows.extend(_ready_rows("loopback, reference tree", "1", sc, block))
    print_table("figures 1-2: time-to-ready (all N ready) and bytes moved (median)",
                ["link", "N", "node", "contender", "ready s", "spread", "setup s", "env ready s",
                 "MB moved", "MB on link", "docker / this", "bytes / docker"], rows)
    _report_update(summary.get("update"))
    _report_rl(summary.get("rl"))
    _report_budgets(summary["budgets"])


def _ready_rows(label: str, n: str, sc: str, block: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, c in block.items():
        if "all_ready_s" not in c:
            rows.append([label, int(n), sc, name, f"FAILED x{c['failed']}", *[""] * 7])
            continue
        link = c["link_bytes"]["median"] / MB if "link_bytes" in c else float("nan")
        rows.append([label, int(n), sc, f"{name}{_failed(c)}", c["all_ready_s"]["median"],
                     c["all_ready_s"]["spread"], c["median_started_s"]["median"],
                     c["median_ready_s"]["median"], c["bytes"]["median"] / MB, link,
                     c.get("docker_over_this", float("nan")),
                     c.get("bytes_over_docker", float("nan"))])
    return rows


def _failed(cell: dict[str, Any]) -> str:
    return f" ({cell['failed']} failed)" if cell.get("failed") else ""


def _report_update(update: dict[str, Any] | None) -> None:
    if not update:
        return
    rows = [[name, c["total_s"]["median"], c["total_s"]["spread"],
             c["bytes_uploaded"]["median"] / MB]
            for name, c in update.items() if isinstance(c, dict)]
    print_table("figure 3: republish after bumping one shared component (median)",
                ["contender", "seconds", "spread", "MB uploaded"], rows)
    if "docker_over_weenv_time" in update:
        print(f"docker / weenv: time {update['docker_over_weenv_time']:.3g}x, "
              f"bytes {update['docker_over_weenv_bytes']:.3g}x")


def _report_rl(rl: dict[str, Any] | None) -> None:
    if not rl:
        return
    rows = [[int(k), sc, f"{name}{_failed(c)}", c["wall_s"]["median"], c["wall_s"]["spread"],
             100 * c["tax_share"]["median"], 100 * c["setup_teardown_share"]["median"]]
            if "wall_s" in c else [int(k), sc, name, f"FAILED x{c['failed']}", "", "", ""]
            for k, by_sc in rl["by_k"].items() for sc, block in by_sc.items()
            for name, c in block.items()]
    print_table(f"figure 4: RL iteration (ideal task time {rl['ideal_s']:.2f} s; median)",
                ["K", "node", "contender", "wall s", "spread", "env tax %",
                 "setup+teardown %"], rows)


def _report_budgets(budgets: dict[str, Any]) -> None:
    for case, entry in budgets.items():
        for name, b in entry.items():
            if not isinstance(b, dict):
                continue
            parts = [f"bytes {100 * b['bytes_fraction_of_image']:.1f}% of the image "
                     f"({'within' if b['bytes_within_budget'] else 'OVER'} 15%)"]
            if "speedup" in b:
                parts.insert(0, f"{b['speedup']:.3g}x faster than Docker "
                                f"({'within' if b['speedup_within_budget'] else 'SHORT of'} 15x)")
            print(f"budget, {case} cold N=1, {name}: " + "; ".join(parts))


# -- plots ----------------------------------------------------------------------------------------


def plot_all(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Draw the four figures into `out_dir`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = results["summary"]
    written = []
    if summary["ready"]:
        written.append(_plot_ready(summary, out_dir, "all_ready_s", "coldstart-ready.png",
                                   "time until all N environments are ready (s, log)",
                                   log=True))
        written.append(_plot_ready(summary, out_dir, "bytes", "coldstart-bytes.png",
                                   "bytes moved to get ready (MB, log)", scale=MB, log=True))
    if summary.get("update"):
        written.append(_plot_update(summary["update"], results["update"]["n"], out_dir))
    if summary.get("rl"):
        written.append(_plot_rl(summary["rl"], out_dir))
    return written


COLORS = {"docker": "#1f77b4", "weenv": "#ff7f0e", "weenv + hints": "#2ca02c"}


def _plot_ready(summary: dict[str, Any], out_dir: Path, key: str, name: str, ylabel: str,
                scale: float = 1.0, log: bool = False) -> Path:
    import matplotlib.pyplot as plt

    labels = list(summary["ready"])
    fig, axes = plt.subplots(1, len(labels), figsize=(6.5 * len(labels), 4.2), squeeze=False)
    for ax, label in zip(axes[0], labels, strict=True):
        groups = [(n, sc, block) for n, by_sc in summary["ready"][label].items()
                  for sc, block in by_sc.items()]
        names = list(groups[0][2]) if groups else []
        width = 0.8 / max(1, len(names))
        for j, cname in enumerate(names):
            xs = [i + j * width for i in range(len(groups))]
            nan = {"median": math.nan, "min": math.nan, "max": math.nan}
            cells = [g[2][cname].get(key, nan) for g in groups]
            med = [c["median"] / scale for c in cells]
            err = [[(c["median"] - c["min"]) / scale for c in cells],
                   [(c["max"] - c["median"]) / scale for c in cells]]
            ax.bar(xs, med, width, yerr=err, label=cname, color=COLORS.get(cname), capsize=2)
            if key == "all_ready_s" and cname != "docker":
                for x, g, m in zip(xs, groups, med, strict=True):
                    ratio = g[2][cname].get("docker_over_this")
                    if ratio and not math.isnan(ratio):
                        ax.annotate(f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x",
                                    (x, m), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{sc}\nN={n}" for n, sc, _ in groups])
        ax.set_title(label)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_update(update: dict[str, Any], n: int, out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    names = [k for k, v in update.items() if isinstance(v, dict)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, key, scale, title in ((a, "total_s", 1.0, "time to republish (s)"),
                                  (b, "bytes_uploaded", MB, "bytes uploaded (MB, log)")):
        med = [update[x][key]["median"] / scale for x in names]
        ax.bar(names, med, color=[COLORS.get(x) for x in names])
        ax.set_title(title)
        for i, m in enumerate(med):
            ax.annotate(f"{m:.3g}", (i, m), ha="center", va="bottom", fontsize=8)
    b.set_yscale("log")
    fig.suptitle(f"bump one shared component for {n} task environments")
    fig.tight_layout()
    path = out_dir / "coldstart-update.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_rl(rl: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    bars = [(f"K={k} {sc}\n{name}", c) for k, by_sc in rl["by_k"].items()
            for sc, block in by_sc.items() for name, c in block.items() if "wall_s" in c]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(bars)), 4))
    ideal = rl["ideal_s"]
    walls = [c["wall_s"]["median"] for _, c in bars]
    ax.bar(range(len(bars)), [ideal] * len(bars), color="#cccccc", label="the task itself")
    ax.bar(range(len(bars)), [w - ideal for w in walls], bottom=[ideal] * len(bars),
           color="#d62728", label="environment (setup, lazy loading, teardown)")
    for i, (_, c) in enumerate(bars):
        ax.annotate(f"{100 * c['tax_share']['median']:.1f}%", (i, walls[i]), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([label for label, _ in bars], fontsize=7)
    ax.set_ylabel("iteration wall time (s)")
    ax.set_title(f"RL iteration: each environment runs its commands, then {rl['think_s']:g} s")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    path = out_dir / "coldstart-rl.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
