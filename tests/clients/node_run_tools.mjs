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
import { WEATHER, memproxyClient, weatherIn } from "./openai_node.mjs";

const plan = JSON.parse(process.argv[2]);
const client = memproxyClient(plan.history === "new" ? { "X-Memproxy-History": "new" } : {});
const tools = [{
  type: "function",
  function: {
    ...WEATHER,
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"],
                  additionalProperties: false },
    strict: true,
    function: ({ city }) => weatherIn(city),
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
