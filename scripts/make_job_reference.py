"""Write docs/jobs.md, the job-file reference, from the config schema (miles/config.py).

    python scripts/make_job_reference.py            # rewrite docs/jobs.md (it is committed)
    python scripts/make_job_reference.py --check    # exit 1 if a rerun would change it

Every key of every group: its type and allowed values (from the pydantic fields and their
constraints), its default, and what it means (the field's comment in miles/config.py; a
comment line below a field continues it, a `# -- ` line heads the fields after it).
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import tokenize
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bundled_files import write_or_check  # noqa: E402

from miles import config  # noqa: E402

INTRO = """\
# Job file reference

Generated from `miles/config.py` by `scripts/make_job_reference.py`; do not edit by hand (a test
fails when this file is stale). A job file is YAML with the groups below; every key is optional
and has the default shown. Overrides on the command line name keys with dots, values read as
YAML: `miles run JOB.yaml train.optim.lr=1e-5 train.parallel.tp=2`. Unknown keys, wrong types
and values out of range are errors that name the field, before anything starts (exit status 2);
`miles run JOB.yaml --check` prints the job resolved. Secrets never go in a job file: wandb reads
`WANDB_API_KEY` from the environment, Ray its token from `RAY_AUTH_TOKEN_PATH`.
"""


def comments(cls: type) -> dict[str, tuple[str | None, str]]:
    """field -> (the `# -- ` heading above it or None, its comment text) from cls's source."""
    src = inspect.getsource(cls)
    fields = {n.target.id: n.lineno for n in ast.parse(src).body[0].body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    by_line: dict[int, str] = {}
    alone: set[int] = set()  # comment lines with no code before them
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[:tok.start[1]].strip():
                alone.add(tok.start[0])
    out, heading = {}, None
    for name, line in sorted(fields.items(), key=lambda kv: kv[1]):
        above = line - 1
        while above in alone and by_line[above].startswith("-- "):
            heading = by_line[above][3:]
            above -= 1
        text, nxt = [by_line.get(line, "")], line + 1
        while nxt in alone and not by_line[nxt].startswith("-- "):
            text.append(by_line[nxt])
            nxt += 1
        out[name] = (heading, " ".join(t for t in text if t))
    return out


def constraints(meta: list) -> str:
    marks = []
    for m in meta:
        for c in getattr(m, "metadata", [m]):  # Field(gt=0) inside Annotated carries its own list
            for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                if getattr(c, attr, None) is not None and type(c).__name__.lower() == attr:
                    marks.append(f"{sym} {getattr(c, attr)}")
            if getattr(c, "pattern", None):
                marks.append(f"matching `{c.pattern}`")
            if getattr(c, "max_length", None):
                marks.append(f"at most {c.max_length} characters")
    return (" " + ", ".join(marks)) if marks else ""


def type_text(tp: Any, meta: list = ()) -> str:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *inner = get_args(tp)
        return type_text(base, [*inner, *meta])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        text = " or ".join(type_text(a) for a in args)
        return (text + constraints(list(meta))) + (" or null" if len(args) < len(get_args(tp)) else "")
    if origin is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in get_args(tp))
    if origin is list:
        return f"list of {type_text(get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    names = {int: "integer", float: "number", bool: "boolean", str: "string", Path: "path"}
    return names.get(tp, getattr(tp, "__name__", str(tp))) + constraints(list(meta))


def default_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == {} or value == []:
        return "{}" if isinstance(value, dict) else "[]"
    return f"`{value}`"


def group(key: str, cls: type) -> list[str]:
    doc = inspect.getdoc(cls) if cls.__doc__ and cls.__doc__ != config.Section.__doc__ else ""
    lines = [f"## `{key}`", ""] + ([" ".join(doc.split()), ""] if doc else [])
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    notes, nested, last_heading = comments(cls), [], None
    for name, field in cls.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, config.Section):
            nested.append((f"{key}.{name}", field.annotation))
            lines.append(f"| `{name}` | group | | see `{key}.{name}` below |")
            continue
        heading, text = notes.get(name, (None, ""))
        if heading and heading != last_heading:
            lines.append(f"| *{heading}* | | | |")
            last_heading = heading
        text = text.replace("|", "\\|")
        lines.append(f"| `{name}` | {type_text(field.annotation, field.metadata)} | {default_text(field.default)} "
                     f"| {text} |")
    lines.append("")
    for sub, subcls in nested:
        lines += group(sub, subcls)
    return lines


def files() -> dict[str, str]:
    lines = INTRO.splitlines() + [""]
    job = config.JobConfig
    top = [(name, f) for name, f in job.model_fields.items()
           if not (isinstance(f.annotation, type) and issubclass(f.annotation, config.Section))]
    lines += ["## Top level", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    notes = comments(job)
    for name, f in top:
        lines.append(f"| `{name}` | {type_text(f.annotation, f.metadata)} | {default_text(f.default)} | "
                     f"{notes.get(name, (None, ''))[1]} |")
    lines.append("")
    for name, f in job.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, config.Section):
            lines += group(name, f.annotation)
    return {"jobs.md": "\n".join(lines).rstrip() + "\n"}


def main() -> None:
    write_or_check(__doc__, ROOT / "docs", files, "scripts/make_job_reference.py")


if __name__ == "__main__":
    main()
