"""A griffe extension for the API reference (mkdocs.yml): reads the Keras-style
docstrings of keras_fp8 and torch_ops as Google style.

- `Example:` (Keras's heading, its lines not indented, last in the
  docstring, after a blank line) is read as an examples section, so `>>>`
  lines render as code and a fenced block as a fenced block;
- an `Args:` entry that names several parameters over two lines
  (`a, b, c,` then `d: As in ...`) is read as one entry;
- `*args` / `**kwargs` show no default: griffe gives them `()` / `{}` so
  that they do not count as required, which the parameter tables would
  print as if it were a default value.
"""

import re

import griffe

_EXAMPLE_HEADING = re.compile(r"^Examples?:[ \t]*$", re.MULTILINE)
_NAME_LIST_BREAK = re.compile(r"^(\s+(?:[\w*]+, )+[\w*]+,)\n\s+(?=[\w*])", re.MULTILINE)
_VARIADIC = (griffe.ParameterKind.var_positional, griffe.ParameterKind.var_keyword)


class KerasStyleDocstrings(griffe.Extension):
    """Rewrites the Keras-style forms before griffe parses a docstring."""

    def on_object(self, *, obj, **kwargs):
        if isinstance(obj, griffe.Function):
            for parameter in obj.parameters:
                if parameter.kind in _VARIADIC:
                    parameter.default = None
        docstring = obj.docstring
        if docstring is None:
            return
        value = docstring.value
        heading = _EXAMPLE_HEADING.search(value)
        if heading is not None:
            body = value[heading.end():].split("\n")
            if not any(line.startswith((" ", "\t")) for line in body if line.strip()):
                # griffe's section ends at a blank line: none between the
                # heading and the first line of the example.
                while body and not body[0].strip():
                    body.pop(0)
                indented = "\n".join("    " + line if line.strip() else line for line in body)
                value = value[:heading.start()] + "Examples:\n" + indented
        joined = None
        while joined != value:
            joined, value = value, _NAME_LIST_BREAK.sub(r"\1 ", value)
        docstring.value = value
