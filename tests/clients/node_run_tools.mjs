// A conversation held with the `openai` npm package's tool runner, driven by tests/test_clients.py.
//
// argv[2]: the plan, as JSON: {"history": "full" | "new", "system": str, "model": str,
// "turns": [{"text", "stream"}]}. Environment: MEMPROXY_BASE_URL, MEMPROXY_KEY, MEMPROXY_SESSION, and
// OPENAI_NODE_PREFIX, the npm prefix the test installed the package into.
//
// Each turn is one `client.chat.completions.runTools(...)` (streamed where the turn says) with a
// strict `get_weather` tool the runner calls itself and a strict JSON schema for the answer: the
// runner resends its growing message list at each step. A "full" client starts each turn from the
// previous runner's `messages` (its whole history, the assistant messages as the SDK returned them);
// a "new" client says so (`X-Memproxy-History: new`) and starts each turn from the system prompt and
// the new question alone. Printed as JSON on stdout: each turn's final message (content, parsed,
// refusal) and the tool results the runner produced.
import { createRequire } from "node:module";
import { join } from "node:path";

const require = createRequire(join(process.env.OPENAI_NODE_PREFIX, "package.json"));
const sdk = require("openai");
const OpenAI = sdk.OpenAI ?? sdk.default ?? sdk;

const plan = JSON.parse(process.argv[2]);
const client = new OpenAI({
  baseURL: process.env.MEMPROXY_BASE_URL,
  apiKey: process.env.MEMPROXY_KEY,
  defaultHeaders: {
    "X-Session-Id": process.env.MEMPROXY_SESSION,
    ...(plan.history === "new" ? { "X-Memproxy-History": "new" } : {}),
  },
  maxRetries: 0,
  timeout: 30_000,
});
const tools = [{
  type: "function",
  function: {
    name: "get_weather",
    description: "The weather in a city.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"],
                  additionalProperties: false },
    strict: true,
    function: ({ city }) => `${city}: 18C and sunny`,
    parse: JSON.parse,
  },
}];
const responseFormat = { type: "json_schema", json_schema: { name: "mood", strict: true, schema: {
  type: "object", properties: { name: { type: "string" }, mood: { type: "string" } }, required: ["name", "mood"],
  additionalProperties: false } } };

const system = { role: "system", content: plan.system };
let history = [system];
const out = [];
for (const turn of plan.turns) {
  const messages = [...(plan.history === "full" ? history : [system]), { role: "user", content: turn.text }];
  const params = { model: plan.model, messages, tools, response_format: responseFormat };
  const runner = client.chat.completions.runTools(turn.stream ? { ...params, stream: true } : params);
  const results = [];
  runner.on("functionToolCallResult", (result) => results.push(result));
  const message = (await runner.finalChatCompletion()).choices[0].message;
  history = runner.messages;
  out.push({ content: message.content, parsed: message.parsed ?? null, refusal: message.refusal ?? null, results });
}
process.stdout.write(JSON.stringify(out) + "\n");
