"""What the monitor's records say: thresholds, non-finite values, the
one-line health summary and the summary logs.

A record is one layer and role at one step: `{"step", "epoch", "layer",
"role"}` and the statistics (`statistics.STATS`). NaN in `saturation`,
`underflow`, `sqnr_db` or `nonfinite` means "not measured" (no tensor, or a
block-scaled recipe); a non-finite `amax` or `scale`, or a `nonfinite`
count above zero, is a non-finite value the layer holds or produced.
"""

import math

# `(stat, pick, log key, label, format)` of the summary values.
_WORST = (
    ("saturation", max, "fp8/saturation_max", "saturation max", "{:.2%}"),
    ("underflow", max, "fp8/underflow_max", "underflow max", "{:.2%}"),
    ("sqnr_db", min, "fp8/sqnr_db_min", "SQNR min", "{:.1f} dB"),
)
NONFINITE_LOG = "fp8/nonfinite_layers"
SUMMARY_LOGS = tuple(key for _, _, key, _, _ in _WORST) + (NONFINITE_LOG,)
# The layers with non-finite values named in a line; the rest are counted.
_NAMED_LAYERS = 3

_ADVICE = {
    "saturation": ("saturate", "the scale lags the tensor's growth; a margin (DelayedScaling(margin=1)), a "
                               "shorter history or CurrentScaling() gives it headroom"),
    "underflow": ("underflow to zero", "the scale is large for most of the tensor (an outlier in the amax "
                                       "history?); a shorter history_len or amax_compute_algo='most_recent' "
                                       "lets it follow the tensor"),
}


def threshold_messages(record, thresholds, warned):
    """The warnings `record` earns: its saturation or underflow past
    `thresholds[stat]`, once per layer, role and statistic (`warned` keeps
    which were given, and is updated)."""
    messages = []
    for stat, threshold in thresholds.items():
        value = record[stat]
        key = (record["layer"], record["role"], stat)
        if math.isnan(value) or value <= threshold or key in warned:
            continue
        warned.add(key)
        what, advice = _ADVICE[stat]
        messages.append(
            f"FP8Monitor: layer '{record['layer']}' ({record['role']}): {value:.2%} of the elements {what} at "
            f"step {record['step']} (threshold {threshold:.2%}): {advice}.")
    return messages


def nonfinite_findings(records):
    """`{layer: [finding, ...]}` for the layers of `records` (one step) that
    hold or produced non-finite values, in record order; a finding is e.g.
    `"kernel: 12 non-finite elements"` or `"grad amax nan"`."""
    found = {}
    for r in records:
        items = []
        if not math.isnan(r["nonfinite"]) and r["nonfinite"] > 0:
            items.append(f"{r['role']}: {int(r['nonfinite'])} non-finite elements")
        for stat in ("amax", "scale"):
            if not math.isfinite(r[stat]):
                items.append(f"{r['role']} {stat} {r[stat]}")
        if items:
            found.setdefault(r["layer"], []).extend(items)
    return found


def _named(findings, quote=""):
    """The first `_NAMED_LAYERS` layers of `findings` with what they hold,
    and how many more."""
    named = [f"{quote}{layer}{quote} ({', '.join(items)})" for layer, items in findings.items()]
    more = len(named) - _NAMED_LAYERS
    return "; ".join(named[:_NAMED_LAYERS]) + (f"; and {more} more" if more > 0 else "")


def nonfinite_message(step, findings):
    """The one warning about non-finite values (`nonfinite_findings`)."""
    named = _named(findings, quote="'")
    return (f"FP8Monitor: non-finite values at step {step} in {len(findings)} layer(s): {named}. A NaN or inf "
            "in a batch, a weight or a scale spreads to the loss and, through the optimizer, to the weights; "
            "the monitor keeps counting them (health_summary(), records).")


def _worst(records, stat, pick):
    rows = [r for r in records if not math.isnan(r[stat])]
    if not rows:
        return None
    return pick(rows, key=lambda r: r[stat])


def summary_logs(records):
    """The summary values of one step's records, `SUMMARY_LOGS`: the worst
    saturation, underflow and SQNR over every layer and role (left out where
    nothing was measured) and the number of layers with non-finite values."""
    if not records:
        return {}
    logs = {}
    for stat, pick, key, _, _ in _WORST:
        row = _worst(records, stat, pick)
        if row is not None:
            logs[key] = row[stat]
    logs[NONFINITE_LOG] = float(len(nonfinite_findings(records)))
    return logs


def summary(records, warnings):
    """One line: the non-finite values and the worst saturation, underflow
    and SQNR of the latest step in `records`, and the number of
    `warnings`."""
    if not records:
        return "FP8 health: nothing measured yet."
    step = records[-1]["step"]
    latest = [r for r in records if r["step"] == step]
    parts = []
    findings = nonfinite_findings(latest)
    if findings:
        parts.append(f"NON-FINITE values in {len(findings)} layer(s): {_named(findings)}")
    for stat, pick, _, label, fmt in _WORST:
        row = _worst(latest, stat, pick)
        if row is not None:
            parts.append(f"{label} {fmt.format(row[stat])} ({row['layer']}/{row['role']})")
    n_layers = len({r["layer"] for r in latest})
    warned = f"{len(warnings)} warning(s)" if warnings else "no warnings"
    if not parts:
        parts.append("amax and scales only (no probe batch)")
    return f"FP8 health at step {step} ({n_layers} layers): " + ", ".join(parts) + f"; {warned}."
