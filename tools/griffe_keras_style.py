"""A griffe extension for the API reference (mkdocs.yml): reads the Keras-style
docstrings of keras_fp8 and torch_ops as Google style.

- `Example:` (Keras's heading, its lines not indented, last in the
  docstring) is read as an examples section, so `>>>` lines render as code;
- an `Args:` entry that names several parameters over two lines
  (`a, b, c,` then `d: As in ...`) is read as one entry.
"""

import re

import griffe

_EXAMPLE_HEADING = re.compile(r"^Examples?:[ \t]*$", re.MULTILINE)
_NAME_LIST_BREAK = re.compile(r"^(\s+(?:[\w*]+, )+[\w*]+,)\n\s+(?=[\w*])", re.MULTILINE)


class KerasStyleDocstrings(griffe.Extension):
    """Rewrites the two Keras-style forms before griffe parses a docstring."""

    def on_object(self, *, obj, **kwargs):
        docstring = obj.docstring
        if docstring is None:
            return
        value = docstring.value
        heading = _EXAMPLE_HEADING.search(value)
        if heading is not None:
            body = value[heading.end():].split("\n")
            if not any(line.startswith((" ", "\t")) for line in body if line.strip()):
                indented = "\n".join("    " + line if line.strip() else line for line in body)
                value = value[:heading.start()] + "Examples:" + indented
        joined = None
        while joined != value:
            joined, value = value, _NAME_LIST_BREAK.sub(r"\1 ", value)
        docstring.value = value
