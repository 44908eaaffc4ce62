"""``docs/config.md``, generated from the config schema: ``python -m jaxoffload.train.reference``.

Each section's table comes from its dataclass: the key, its default, and the
key's entry in the ``Attributes`` section of the class's docstring (or of the
class it inherits the field from); the prose above the table is the rest of
that docstring. A key without an entry is an error, so the reference cannot
fall behind the schema.

  python -m jaxoffload.train.reference > docs/config.md
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

from jaxoffload.train.config import Config

HEADER = """\
# Configuration reference

`python -m jaxoffload.train [--config FILE.yaml] [section.key=value ...]`

A YAML file holds sections (`model`, `optimizer`, `train`, `data`, `logging`, `mesh`,
`distributed`, `checkpoint`), and may start from another file with `base_config:
other.yaml` (relative to it; its keys override the base's). Overrides on the command
line use dotted keys and YAML values (`True`, `0.5`, `null`, `3e-4`). Key names follow
NeMo Megatron-Bridge where it has one. Everything is checked once, before anything
compiles; a problem prints one line naming the key and what is allowed, and exits with
status 2.

This page is generated from the docstrings of `jaxoffload/train/config.py` and `run_config.py`
(`python -m jaxoffload.train.reference > docs/config.md`).
"""


def attributes(cls: type) -> dict[str, str]:
  """The ``Attributes:`` entries of ``cls``'s docstring and its bases', by name."""
  entries: dict[str, str] = {}
  for klass in reversed(cls.__mro__):
    _, block = _split(inspect.getdoc(klass) or "")
    name = None
    for line in block.splitlines():
      match = re.match(r"(\w+): (.*)", line)
      if match:
        name, text = match.groups()
        entries[name] = text
      elif name and line.startswith("  "):
        entries[name] += " " + line.strip()
  return entries


def _split(doc: str) -> tuple[str, str]:
  """A docstring's prose and its ``Attributes:`` block (dedented)."""
  prose, _, block = doc.partition("\nAttributes:\n")
  return prose, "\n".join(line[2:] for line in block.splitlines())


def _default(value) -> str:
  return "null" if value is None else str(value)


def section(name: str, cls: type) -> str:
  """The reference of one section: its prose and a table of its keys."""
  docs = attributes(cls)
  prose, _ = _split(inspect.getdoc(cls) or "")
  summary, _, body = prose.partition("\n")
  summary = summary.split(": ", 1)[-1].rstrip(".")
  lines = [f"## {name}", "", summary[0].upper() + summary[1:] + ".", ""]
  if body.strip():
    lines += [body.strip(), ""]
  lines += ["| key | default | meaning |", "|---|---|---|"]
  for field in dataclasses.fields(cls):
    if field.name not in docs:
      raise ValueError(f"{cls.__name__}.{field.name} has no entry in an Attributes docstring")
    lines.append(f"| `{field.name}` | {_default(field.default)} | {docs[field.name]} |")
  # Docstrings quote code in reStructuredText's double backticks; Markdown takes one.
  return "\n".join(lines).replace("``", "`")


def reference() -> str:
  """The whole of ``docs/config.md``."""
  sections = typing.get_type_hints(Config)
  return "\n\n".join([HEADER.rstrip()] + [section(name, cls) for name, cls in sections.items()]
                     ) + "\n"


if __name__ == "__main__":
  print(reference(), end="")
