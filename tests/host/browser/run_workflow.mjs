// Load a UI-format workflow into the real ComfyUI frontend in headless Debian chromium, queue it, wait for
// the prompt to finish and for the pack's KV chart (web/unicache.js), take a screenshot, print a JSON result.
//
//   node run_workflow.mjs URL WORKFLOW_UI.json SCREENSHOT.png [TIMEOUT_S] [WIDGETS_JSON]
//
// WIDGETS_JSON (optional): {"<node id>": {"<widget name>": value}} set in the loaded graph before it is queued,
// as a user types them (e.g. an empty Text Item).
// The result (stdout, last line) says which node types the frontend lacks, which dialogs were open, the
// prompt's history status, what the report node shows and the warnings web/unicache.js shows on each node.
// The Python test asserts on it.
import { chromium } from "playwright-core";
import { readFileSync, mkdirSync } from "node:fs";
import { dirname } from "node:path";

const [url, workflowPath, screenshot, timeoutArg, widgetsArg] = process.argv.slice(2);
const widgetEdits = JSON.parse(widgetsArg || "{}");
const timeoutMs = 1000 * Number(timeoutArg || 600);
const workflow = JSON.parse(readFileSync(workflowPath, "utf8"));
const result = { url, workflow: workflowPath, console_errors: [] };

async function history() {
  const r = await fetch(`${url}/history?max_items=64`);
  return r.json();
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"],
});
try {
  // UNICACHE_VIEWPORT=WxH (docs/nodes.md's screenshots: large enough that the fitted graph keeps its text)
  const [vw, vh] = (process.env.UNICACHE_VIEWPORT || "1280x800").split("x").map(Number);
  const page = await browser.newPage({ viewport: { width: vw, height: vh } });
  page.on("console", (m) => { if (m.type() === "error") result.console_errors.push(m.text().slice(0, 300)); });
  await page.goto(url, { waitUntil: "domcontentloaded", timeout: 120000 });
  await page.waitForFunction(() => window.app && window.app.graph, null, { timeout: 120000 });
  // every node type of the workflow must be registered in the frontend (else: the missing-nodes dialog)
  result.types = [...new Set(workflow.nodes.map((n) => n.type))];
  result.missing = await page.evaluate((types) => {
    const reg = window.LiteGraph?.registered_node_types || {};
    return types.filter((t) => !(t in reg) && !["Note", "MarkdownNote"].includes(t));
  }, result.types);
  const before = new Set(Object.keys(await history()));
  await page.evaluate((wf) => window.app.loadGraphData(wf), workflow);
  await page.waitForTimeout(1500);
  result.dialogs = await page.evaluate(() =>
    [...document.querySelectorAll(".p-dialog, [role=dialog]")].map((d) => d.innerText.slice(0, 300)));
  result.graph_nodes = await page.evaluate(() => window.app.graph._nodes.map((n) => n.type));
  result.edited = await page.evaluate((edits) => {
    const done = [];
    for (const [id, values] of Object.entries(edits)) {
      const node = window.app.graph.getNodeById(Number(id));
      for (const [name, value] of Object.entries(values)) {
        const widget = node?.widgets?.find((w) => w.name === name);
        if (!widget) continue;
        widget.value = value;
        widget.callback?.(value);
        done.push(`${id}.${name}`);
      }
    }
    return done;
  }, widgetEdits);
  await page.evaluate(() => window.app.queuePrompt(0, 1));
  // the prompt shows up in /history when done
  const t0 = Date.now();
  let entry = null;
  while (Date.now() - t0 < timeoutMs) {
    const h = await history();
    const id = Object.keys(h).find((k) => !before.has(k));
    if (id && h[id].status && ["success", "error"].includes(h[id].status.status_str)) {
      entry = h[id];
      result.prompt_id = id;
      break;
    }
    await page.waitForTimeout(500);
  }
  result.seconds = (Date.now() - t0) / 1000;
  result.status = entry ? entry.status.status_str : "timeout";
  result.outputs = entry ? Object.keys(entry.outputs) : [];
  result.errors = entry ? entry.status.messages.filter((m) => m[0] === "execution_error").map((m) => m[1].exception_message) : [];
  // the report node's state in the frontend: what web/unicache.js attached once it executed
  await page.waitForTimeout(1500);
  result.report_nodes = await page.evaluate(() =>
    window.app.graph._nodes.filter((n) => n.type === "UniCacheKVReport").map((n) => ({
      id: n.id,
      widgets: (n.widgets || []).map((w) => ({ name: w.name, type: w.type })),
      has_chart_data: !!(n.unicacheKV || n.unicache_kv || n.properties?.unicache_kv || n._unicacheChart),
      chart_canvases: document.querySelectorAll(`[data-unicache-node="${n.id}"] canvas, .unicache-kv-chart`).length,
      imgs: (n.imgs || []).length,
    })));
  result.warnings = await page.evaluate(() =>
    window.app.graph._nodes
      .filter((n) => n.unicacheWarning && n.unicacheWarning.style.display !== "none")
      .map((n) => {
        const rect = n.unicacheWarning.getBoundingClientRect();
        return { id: n.id, type: n.type, text: n.unicacheWarning.textContent, shown: rect.width > 0 && rect.height > 0 };
      }));
  result.chart_elements = await page.evaluate(() => document.querySelectorAll(".unicache-kv-chart, [data-unicache-kv]").length);
  if (process.env.UNICACHE_FIT_VIEW) {
    // the whole graph in the picture (docs/nodes.md's screenshots): the frontend's "fit view" command
    await page.evaluate(() => window.app.extensionManager?.command?.execute?.("Comfy.Canvas.FitView"));
    await page.evaluate(() => document.querySelectorAll(".p-toast, [role=alert]").forEach((e) => e.remove()));
    await page.waitForTimeout(800);
  }
  await page.waitForTimeout(500);
  mkdirSync(dirname(screenshot), { recursive: true });
  await page.screenshot({ path: screenshot });
  result.screenshot = screenshot;
} finally {
  await browser.close();
}
console.log(JSON.stringify(result));
