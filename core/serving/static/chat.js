// The chat page: the conversation is kept here and sent whole to /v1/chat/completions
// with stream: true; the answer is shown as its server-sent events arrive.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // {role, content} of the conversation so far
let model = null;
let controller = null;  // the AbortController of the answer being streamed

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function bubble(cls, text) {
  const div = document.createElement("div");
  div.className = "msg " + cls;
  div.textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({block: "end"});
  return div;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    model = body.data[0].id;
    $("model").textContent = model;
  } catch (e) {
    $("model").textContent = "(model name unknown: " + e.message + ")";
  }
}

// Server-sent events: blocks separated by a blank line, each "data: ..." line a payload.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  history.push({role: "user", content: text});
  bubble("user", text);
  const answer = bubble("assistant", "");
  answer.dataset.done = "false";
  busy(true);
  const started = performance.now();
  let tokens = 0, firstAt = null;
  controller = new AbortController();
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({model: model || undefined, messages: history, stream: true,
                            stream_options: {include_usage: true},
                            temperature: Number($("temperature").value),
                            max_tokens: Number($("max-tokens").value)}),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : r.status + " " + r.statusText);
    }
    for await (const data of events(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const piece = choice.delta && choice.delta.content;
        if (piece) {
          if (firstAt === null) firstAt = performance.now();
          answer.textContent += piece;
          answer.scrollIntoView({block: "end"});
        }
      }
    }
    const secs = (performance.now() - started) / 1000;
    const ttft = firstAt === null ? "-" : ((firstAt - started) / 1000).toFixed(2) + " s";
    bubble("stats", `${tokens} tokens in ${secs.toFixed(2)} s, first after ${ttft}`);
  } catch (e) {
    if (e.name !== "AbortError") bubble("error", e.message);
  } finally {
    answer.dataset.done = "true";
    // what was said stays in the conversation (an interrupted answer as far as it got)
    if (answer.textContent) history.push({role: "assistant", content: answer.textContent});
    else history.pop();
    controller = null;
    busy(false);
  }
}

function busy(on) {
  $("send").disabled = on;
  $("stop").hidden = !on;
  if (!on) $("input").focus();
}

$("form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("api-key").addEventListener("change", loadModel);
loadModel();
