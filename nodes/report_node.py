"""``UniCacheKVReport``: a KV report → a plot (IMAGE), a summary (STRING) and the web chart's ``ui`` data."""

from __future__ import annotations

from unicache_core.compression.report_view import chart_data, render_plot, summary_text

from .convert import pils_to_image


class UniCacheKVReport:
    DESCRIPTION = (
        "Shows the KV-cache report of a UniCache task node: a plot of the bytes held per token type and "
        "branch and of the retention rho per step, a text summary (full / held / peak bytes, reduction), "
        "and a chart drawn on the node."
    )
    CATEGORY = "UniCache/cache"
    FUNCTION = "show"
    OUTPUT_NODE = True
    RETURN_TYPES = ("IMAGE", "STRING")
    RETURN_NAMES = ("plot", "summary")
    OUTPUT_TOOLTIPS = (
        "The report plot as an image (e.g. for PreviewImage or SaveImage).",
        "The report summary as text.",
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"report": ("UNICACHE_KV_REPORT", {"tooltip": "The kv_report output of a task node."})}}

    def show(self, report):
        plot = pils_to_image([render_plot(report)])
        text = summary_text(report)
        return {"ui": {"unicache_kv": [chart_data(report)], "text": [text]}, "result": (plot, text)}
