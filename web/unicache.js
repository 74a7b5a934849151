// UniCache for BAGEL: draws the KV memory saved and the per-step budget chart on a UniCache node when its
// execution returns the `unicache_kv` ui data (UniCacheKVReport, UniCacheUnderstand).
import { app } from "../../scripts/app.js";

const BRANCH_COLORS = { gen: "#4285f4", cfg_text: "#ea4335", cfg_img: "#34a853", think: "#fbbc04" };
const CHART_HEIGHT = 190;

function fmtBytes(n) {
  if (n === null || n === undefined) return "n/a";
  const units = ["B", "KiB", "MiB", "GiB"];
  let v = Number(n);
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return i === 0 ? `${v.toFixed(0)} ${units[i]}` : `${v.toFixed(1)} ${units[i]}`;
}

function headline(data) {
  const full = data.full_bytes || 0;
  const held = data.steady_bytes ?? full;
  const saved = data.saved_bytes ?? 0;
  const pct = data.reduction != null ? ` (${(data.reduction * 100).toFixed(1)}%)` : "";
  const lines = [
    `${data.method} / ${data.task}: saved ${fmtBytes(saved)}${pct} of KV memory`,
    `held ${fmtBytes(held)} of ${fmtBytes(full)} compressible; peak ${fmtBytes(data.peak_bytes)}`,
  ];
  const images = Object.entries(data.images || {});
  if (images.length > 0) {
    // the KV each input image's rows hold, summed over the branches (request order, counted from 1)
    lines.push(
      images.map(([i, v]) => `image ${Number(i) + 1}: ${fmtBytes(v.held_bytes)} of ${fmtBytes(v.full_bytes)}`).join(" · ")
    );
  }
  return lines;
}

// Retained share per step and branch: rho where the method has one, else held / full bytes.
function budgetSeries(data) {
  const out = [];
  for (const [name, s] of Object.entries(data.series || {})) {
    const pts = [];
    for (let i = 0; i < s.x.length; i++) {
      const rho = s.rho[i];
      const value = rho !== null && rho !== undefined ? rho : s.full_bytes[i] ? s.bytes[i] / s.full_bytes[i] : 1;
      pts.push([s.x[i], Math.max(0, Math.min(1, value))]);
    }
    out.push([name, pts]);
  }
  return out;
}

export function drawChart(ctx, data, width, height) {
  ctx.save();
  ctx.fillStyle = "#1e1e1e";
  ctx.fillRect(0, 0, width, height);
  ctx.font = "12px sans-serif";
  ctx.fillStyle = "#e8e8e8";
  const lines = headline(data);
  lines.forEach((line, i) => ctx.fillText(line, 8, 16 + i * 15));
  const x0 = 34, x1 = width - 70, y0 = 18 + lines.length * 15, y1 = height - 18;
  ctx.strokeStyle = "#555";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(x0, y0);
  ctx.lineTo(x0, y1);
  ctx.lineTo(x1, y1);
  ctx.stroke();
  ctx.fillStyle = "#aaa";
  for (const v of [0, 0.5, 1]) {
    const y = y1 - (y1 - y0) * v;
    ctx.fillText(v.toFixed(1), 6, y + 4);
  }
  const series = budgetSeries(data);
  const xs = series.flatMap(([, pts]) => pts.map((p) => p[0]));
  const lo = xs.length ? Math.min(...xs) : 0;
  const hi = xs.length ? Math.max(...xs) : 1;
  const span = Math.max(1, hi - lo);
  series.forEach(([name, pts], k) => {
    ctx.strokeStyle = BRANCH_COLORS[name] || "#999";
    ctx.fillStyle = ctx.strokeStyle;
    ctx.lineWidth = 2;
    ctx.beginPath();
    pts.forEach(([x, v], i) => {
      const px = x0 + ((x1 - x0) * (x - lo)) / span;
      const py = y1 - (y1 - y0) * v;
      if (i === 0) ctx.moveTo(px, py);
      else ctx.lineTo(px, py);
    });
    if (pts.length === 1) ctx.arc(x0, y1 - (y1 - y0) * pts[0][1], 3, 0, 2 * Math.PI);
    ctx.stroke();
    ctx.fillText(name, x1 + 8, y0 + 12 + k * 14);
  });
  ctx.fillStyle = "#aaa";
  ctx.fillText(`budget per step (step ${lo}-${hi})`, x0 + 4, y1 + 14);
  ctx.restore();
}

function render(node) {
  const data = node.unicacheKV;
  if (!data || !node.unicacheCanvas) return;
  const canvas = node.unicacheCanvas;
  const width = Math.max(240, (node.size?.[0] || 320) - 20);
  const ratio = window.devicePixelRatio || 1;
  canvas.width = width * ratio;
  canvas.height = CHART_HEIGHT * ratio;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${CHART_HEIGHT}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  drawChart(ctx, data, width, CHART_HEIGHT);
}

function ensureCanvas(node) {
  if (node.unicacheCanvas) return;
  const canvas = document.createElement("canvas");
  canvas.className = "unicache-kv-chart";
  node.unicacheCanvas = canvas;
  if (typeof node.addDOMWidget === "function") {
    node.addDOMWidget("unicache_kv_chart", "unicache_kv_chart", canvas, {
      serialize: false,
      hideOnZoom: false,
      getMinHeight: () => CHART_HEIGHT + 10,
    });
  } else {
    // older frontends: paint the same chart under the widgets
    const orig = node.onDrawForeground;
    node.onDrawForeground = function (ctx) {
      orig?.apply(this, arguments);
      if (!this.unicacheKV || this.flags?.collapsed) return;
      ctx.save();
      ctx.translate(10, this.size[1] - CHART_HEIGHT - 10);
      drawChart(ctx, this.unicacheKV, this.size[0] - 20, CHART_HEIGHT);
      ctx.restore();
    };
  }
  const size = node.computeSize ? node.computeSize() : node.size;
  node.setSize([Math.max(node.size[0], size[0], 360), Math.max(node.size[1], size[1])]);
}

// The answer of UniCacheUnderstand, shown read-only on the node.
function showText(node, text) {
  if (!node.unicacheText) {
    const area = document.createElement("textarea");
    area.className = "unicache-answer";
    area.readOnly = true;
    area.style.cssText = "width:100%;min-height:60px;font-size:12px;background:#222;color:#ddd;border:none;resize:none";
    node.unicacheText = area;
    if (typeof node.addDOMWidget === "function") {
      node.addDOMWidget("unicache_answer", "unicache_answer", area, { serialize: false, getMinHeight: () => 70 });
    }
  }
  node.unicacheText.value = text;
}

// The node's warnings (its `ui.unicache_warnings`: an empty text, images resized, more images than the model was
// trained on), shown on the node until its next run; the server logs them too.
function showWarnings(node, lines) {
  if (!node.unicacheWarning) {
    if (!lines.length) return;
    const box = document.createElement("div");
    box.className = "unicache-warning";
    box.style.cssText =
      "width:100%;font-size:12px;line-height:1.3;padding:4px 6px;box-sizing:border-box;white-space:pre-wrap;" +
      "background:#4a3b00;color:#ffd95a;border-left:3px solid #ffb300;overflow:auto";
    node.unicacheWarning = box;
    if (typeof node.addDOMWidget === "function") {
      node.addDOMWidget("unicache_warning", "unicache_warning", box, { serialize: false, getMinHeight: () => 48 });
    }
  }
  node.unicacheWarning.textContent = lines.map((line) => `\u26a0 ${line}`).join("\n");
  node.unicacheWarning.style.display = lines.length ? "block" : "none";
  const size = node.computeSize ? node.computeSize() : node.size;
  node.setSize?.([Math.max(node.size[0], size[0]), Math.max(node.size[1], size[1])]);
}

app.registerExtension({
  name: "unicache.bagel.kvchart",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!String(nodeData?.name || "").startsWith("UniCache")) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      onExecuted?.apply(this, arguments);
      showWarnings(this, output?.unicache_warnings || []);
      if (nodeData.name === "UniCacheUnderstand" && output?.text?.length) showText(this, output.text.join("\n"));
      const data = output?.unicache_kv?.[0];
      if (!data) return;
      this.unicacheKV = data;
      ensureCanvas(this);
      render(this);
      this.setDirtyCanvas?.(true, true);
    };
    const onResize = nodeType.prototype.onResize;
    nodeType.prototype.onResize = function () {
      onResize?.apply(this, arguments);
      render(this);
    };
  },
});
