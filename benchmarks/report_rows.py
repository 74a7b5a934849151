"""Adding one method's rows to a committed quality report without running every method again.

``python -m benchmarks.quality --methods lookm --targets paper,robust,extreme --match-from
docs/results/quality.json --json new.json`` runs full KV and the named methods on the report's samples, at the bytes
the report's unicache rows achieved, paired with their per-sample figures (unicache is not run again); then
``python -m benchmarks.report_rows docs/results/quality.json new.json`` puts the new rows into the report, after
its rows of the same task and target, and checks that the new run's full-KV rows are the report's (same samples, same
outputs), so the added rows pair with the report's as if one run had made them all. A ``benchmarks.multi_image``
report takes the rows of a run with ``--methods unicache,...`` the same way; they stay paired with that run's unicache
rows, which they carry when UniCache changed since the report was made.

``--replace`` combines runs split by task or target (``python -m benchmarks.quality --tasks edit --targets extreme
--json edit.json`` beside ``--tasks und ...``, one process each): the new run's rows take the place of the report's
rows of the same task, method and target, rows of a task or target the report lacks are added, and where both have a
task its full-KV rows must still be the same.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report_file import write_text_report
from unicache_commands.flags import OneLineParser, path_arg
from unicache_commands.output_files import save_text


def items(parser, name: str, value: str, allowed) -> tuple[str, ...]:
    """The comma list ``value`` of ``--name``, each one of ``allowed`` (else one error line)."""
    found = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in found if v not in allowed]
    if bad or not found:
        parser.error(f"--{name}: unknown {bad or value!r}; choose from {', '.join(allowed)}")
    return found


def check_match_from(parser, path: Path | None, methods) -> str | None:
    """The ``--match-from`` report's path as a string, after checking it can be used (``None``: not given)."""
    if path is None:
        return None
    if not Path(path).is_file():
        parser.error(f"--match-from {path}: no such report file")
    if "unicache" in methods:
        parser.error("--match-from takes unicache's rows from the report: leave unicache out of --methods")
    return str(path)


def earlier_unicache(path: str, task: str, reduction: float) -> tuple[float, dict]:
    """``(achieved reduction, metrics)`` of the unicache row of the report at ``path`` for ``task`` at ``reduction``
    (its metrics carry the per-sample scores, fidelity to full and step fidelity the other rows pair with)."""
    for row in json.loads(Path(path).read_text(encoding="utf-8"))["results"]:
        if row["task"] == task and row["method"] == "unicache" and row["target_reduction"] == reduction:
            return row["achieved_reduction"], row["metrics"]
    raise ValueError(f"the --match-from report has no unicache row for {task} at {reduction:.0%} reduction")


def _key(row: dict) -> tuple:
    """A quality row's place in a report: ``(task, method, target reduction)``."""
    return (row["task"], row["method"], row.get("target_reduction"))


def merge_reports(report: dict, new: dict, replace: bool = False) -> dict:
    """``report`` with the non-full rows of ``new`` after its rows of the same (task, target); ``new``'s full rows
    must equal ``report``'s (their per-sample scores) for every task both have. A method ``report`` already has at a
    task and target is refused, or with ``replace`` takes the new row's place; full rows of a task ``report`` lacks
    are added."""
    full = {r["task"]: r for r in report["results"] if r["method"] == "full"}
    rows = list(report["results"])
    for row in new["results"]:
        if row["method"] != "full":
            continue
        if row["task"] not in full:
            rows.append(row)
        elif row["metrics"]["per_sample"] != full[row["task"]]["metrics"]["per_sample"]:
            raise ValueError(f"{row['task']}: the new run's full KV differs from the report's (not the same samples)")
    for row in new["results"]:
        if row["method"] == "full" or (row["method"] == "full+taylorseer" and row["task"] in full):
            continue
        key = _key(row)
        at = [i for i, r in enumerate(rows) if _key(r) == key]
        if at and not replace:
            raise ValueError(f"the report already has {row['method']} for {row['task']} at {key[2]:.0%}")
        if at:
            rows[at[0]] = row
            continue
        same = [i for i, r in enumerate(rows) if r["task"] == key[0] and r.get("target_reduction") == key[2]]
        rows.insert(same[-1] + 1 if same else len(rows), row)
    config = dict(report["config"])
    for field in ("methods", "tasks"):
        config[field] = list(dict.fromkeys([*config.get(field, []), *new["config"].get(field, [])]))
    targets = {name: dict(reductions) for name, reductions in config.get("targets", {}).items()}
    for name, reductions in new["config"].get("targets", {}).items():
        targets.setdefault(name, {}).update(reductions)
    config["targets"] = targets
    config.setdefault("added_runs", []).append(
        {
            "methods": new["config"]["methods"],
            "tasks": new["config"].get("tasks"),
            "targets": sorted(new["config"].get("targets", {})),
            "replaced": replace,
            "match_from": new["config"].get("match_from"),
            "seconds": new["config"].get("seconds"),
        }
    )
    return {"config": config, "results": rows}


def merge_multi_image(report: dict, new: dict) -> dict:
    """``report`` (``benchmarks.multi_image``) with the non-unicache rows of ``new`` after its rows of the same task and
    image count (a method ``report`` already has is refused). Each added row keeps its pairing with the unicache row
    of its own run (``unicache_minus_this_step_db``, the same samples); where that unicache row is not the report's
    (UniCache changed since the report was made), the added row also carries it as ``paired_unicache``."""
    rows = list(report["results"])
    mine = {(r["task"], r["images"]): r for r in rows if r["method"] == "unicache"}
    theirs = {(r["task"], r["images"]): r for r in new["results"] if r["method"] == "unicache"}
    for row in new["results"]:
        key = (row["task"], row["images"])
        if row["method"] == "unicache":
            continue
        if any((r["task"], r["images"], r["method"]) == (*key, row["method"]) for r in rows):
            raise ValueError(f"the report already has {row['method']} for {key}")
        paired = theirs.get(key)
        if paired is None:
            raise ValueError(f"{key}: the new run has no unicache row to pair {row['method']} with")
        if key not in mine or paired["per_sample_step_fidelity"] != mine[key]["per_sample_step_fidelity"]:
            fields = ("held_ratio", "step_fidelity_db", "free_fidelity", "per_sample_step_fidelity")
            row = {**row, "paired_unicache": {f: paired[f] for f in fields}}
        same = [i for i, r in enumerate(rows) if (r["task"], r["images"]) == key]
        rows.insert(same[-1] + 1 if same else len(rows), row)
    config = dict(report["config"])
    config["methods"] = list(dict.fromkeys([*config["methods"], *new["config"]["methods"]]))
    return {"config": config, "results": rows}


def _indent(path: Path) -> int:
    """The indent of the JSON file at ``path`` (its second line's leading spaces; 1 when it has none)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return max(1, len(lines[1]) - len(lines[1].lstrip(" "))) if len(lines) > 1 else 1


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.report_rows", description=__doc__.splitlines()[0])
    parser.add_argument("report", type=path_arg, help="the committed report (rewritten with the new rows)")
    parser.add_argument("new", type=path_arg, help="a --match-from run over the same samples")
    parser.add_argument(
        "--replace", action="store_true", help="the new rows replace the report's of the same task, method and target"
    )
    args = parser.parse_args(argv)
    for path in (args.report, args.new):
        if not Path(path).is_file():
            parser.error(f"{path}: no such report file")
    if Path(args.report).resolve() == Path(args.new).resolve():
        parser.error(f"{args.new}: the new rows must come from another file than the report")
    try:
        report, new = (json.loads(Path(p).read_text(encoding="utf-8")) for p in (args.report, args.new))
        if "images" in report["config"]:
            if args.replace:
                parser.error("--replace combines quality reports; a multi_image report is run whole")
            merge, merged = merge_multi_image, merge_multi_image(report, new)
        else:
            merge, merged = merge_reports, merge_reports(report, new, replace=args.replace)
    except (ValueError, KeyError) as exc:
        parser.error(f"{args.new} cannot be added to {args.report}: {exc}")
    save_text(json.dumps(merged, indent=_indent(args.report)) + "\n", args.report, "report")  # its own layout
    if merge is merge_multi_image:  # its table beside it, as the benchmark writes it
        from benchmarks.multi_image import format_table

        write_text_report(Path(args.report).with_suffix(".txt"), format_table(merged), flag="report")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
