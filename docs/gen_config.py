"""Write the configuration reference from ``cgx.config.Config``'s declared fields.

Run by mkdocs-gen-files during ``mkdocs build`` (``plugins: gen-files`` in mkdocs.yml), so
the page is rebuilt from the code every time and cannot drift. Each field of ``Config``
names its ``CGX_*`` variable in the comment on its line or just above it; the default is
the field's, the meaning ``cgx.config.ENV_VARS``'s (what ``cgxrun --help-env`` prints),
and an enum field lists its values with the comments of their declarations.

``python docs/gen_config.py`` prints the page instead.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "cgx" / "config.py"
PAGE = "reference/config.md"
VAR = re.compile(r"\b(CGX_[A-Z0-9_]+)")
HOROVOD = re.compile(r"\belse (HOROVOD_[A-Z0-9_]+)")


def _comments(lines: list[str], node: ast.stmt) -> str:
    """The comment on the statement's line, else the comment lines right above it."""
    line = lines[node.lineno - 1]
    if "#" in line:
        return line.split("#", 1)[1].strip()
    above = []
    i = node.lineno - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        above.insert(0, lines[i].strip()[1:].strip())
        i -= 1
    return " ".join(above)


def _enum_docs(tree: ast.Module, lines: list[str]) -> dict[str, dict[str, str]]:
    """{enum class name: {value: comment}} from the enum declarations' comments."""
    out: dict[str, dict[str, str]] = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        members: dict[str, str] = {}
        for stmt in cls.body:
            if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)):
                text = ""
                line = lines[stmt.lineno - 1]
                if "#" in line:
                    text = line.split("#", 1)[1].strip()
                    j = stmt.lineno  # continuation comment lines below
                    while j < len(lines) and lines[j].strip().startswith("#"):
                        text += " " + lines[j].strip()[1:].strip()
                        j += 1
                members[stmt.value.value] = text
        if members:
            out[cls.name] = members
    return out


def _default(value) -> str:
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*").replace("\n", " ")


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from cgx import config as cfgmod

    source = SOURCE.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config"]
    enums = _enum_docs(tree, lines)
    fields = {f.name: f for f in dataclasses.fields(cfgmod.Config)}

    rows, seen = [], set()
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        comment = _comments(lines, stmt)
        found = VAR.search(comment)
        if not found:
            raise SystemExit(f"cgx/config.py: Config.{name} names no CGX_* variable in its comment")
        var = found.group(1)
        if var not in cfgmod.ENV_VARS:
            raise SystemExit(f"cgx/config.py: {var} (Config.{name}) is missing from ENV_VARS")
        seen.add(var)
        field = fields[name]
        meaning = cfgmod.ENV_VARS[var]
        horovod = HOROVOD.search(comment)
        if horovod and horovod.group(1) not in meaning:
            meaning += f"; else `{horovod.group(1)}`"
        values = ""
        if isinstance(field.default, enum.Enum):
            docs = enums.get(type(field.default).__name__, {})
            values = "<br>".join(
                f"`{m.value}`" + (f": {docs[m.value]}" if docs.get(m.value) else "")
                for m in type(field.default))
        rows.append((var, name, _default(field.default), values, meaning))

    missing = set(cfgmod.ENV_VARS) - seen
    if missing:
        raise SystemExit(f"ENV_VARS lists variables no Config field declares: {sorted(missing)}")

    out = [
        "# Configuration reference",
        "",
        "Generated from `cgx.config.Config` at build time (`docs/gen_config.py`): one row per",
        "field, with its environment variable, its default and its meaning (the text",
        "`cgxrun --help-env` prints). `cgx.Config.from_env()` reads them; an invalid value",
        "fails at start with the variable, the value and the allowed range. Code can build a",
        "`Config` directly or change fields of the environment's: "
        "`cgx.Config.from_env().replace(bits=8)`.",
        "How to use them: [configuration](../guides/configuration.md).",
        "",
        "| variable | `Config` field | default | values | meaning |",
        "|---|---|---|---|---|",
    ]
    for var, name, default, values, meaning in rows:
        out.append(f"| `{var}` | `{name}` | {default} | {_cell(values)} | {_cell(meaning)} |")
    out.append("")
    return "\n".join(out)


def main() -> None:
    try:
        import mkdocs_gen_files
    except ImportError:  # run by hand
        mkdocs_gen_files = None
    text = render()
    if mkdocs_gen_files is None or __name__ == "__main__":
        print(text)
        return
    with mkdocs_gen_files.open(PAGE, "w") as f:
        f.write(text)
    mkdocs_gen_files.set_edit_path(PAGE, "cgx/config.py")


main()
