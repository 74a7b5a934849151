"""``UniCacheKVReport``: a KV report → a plot (IMAGE), a summary (STRING) and the web chart's ``ui`` data."""

from __future__ import annotations

from unicache_core.compression.report_view import chart_data, render_plot, summary_text

from .base import REPORT, UniCacheNode
from .convert import pils_to_image
from .host import io


class UniCacheKVReport(UniCacheNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="UniCacheKVReport",
            display_name="UniCache KV Report",
            category="UniCache/cache",
            description="Shows the KV-cache report of a UniCache task node: a plot of the bytes held per token type "
            "and branch and of the retention rho per step, a text summary (full / held / peak bytes, reduction), "
            "and a chart drawn on the node.",
            is_output_node=True,
            inputs=[REPORT.Input("report", tooltip="The kv_report output of a task node.")],
            outputs=[
                io.Image.Output(
                    "plot",
                    display_name="plot",
                    tooltip="The report plot as an image (e.g. for PreviewImage or SaveImage).",
                ),
                io.String.Output("summary", display_name="summary", tooltip="The report summary as text."),
            ],
        )

    @classmethod
    def execute(cls, report) -> io.NodeOutput:
        plot = pils_to_image([render_plot(report)])
        text = summary_text(report)
        return io.NodeOutput(plot, text, ui={"unicache_kv": [chart_data(report)], "text": [text]})
