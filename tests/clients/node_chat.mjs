// One conversation held by the official `openai` npm package, driven by tests/test_clients.py.
//
// argv[2]: the plan, as JSON: {"history": "full" | "new", "system": str, "turns": [{"text", "stream"}]}.
// Environment: MEMPROXY_BASE_URL, MEMPROXY_KEY, MEMPROXY_SESSION, and OPENAI_NODE_PREFIX, the npm prefix the
// test installed the package into (outside the repo, so it is resolved from there, not from this file).
//
// Each turn sends a user message; while the model asks for tools, the script echoes the assistant message as
// the SDK returned it, answers each call with get_weather's result and asks again. A "full" client resends
// its whole history every time, a "new" client only what it has not sent yet. Streamed turns use the SDK's
// stream helper and its final completion. The replies are printed as JSON on stdout.
import { createRequire } from "node:module";
import { join } from "node:path";

const require = createRequire(join(process.env.OPENAI_NODE_PREFIX, "package.json"));
const sdk = require("openai");
const OpenAI = sdk.OpenAI ?? sdk.default ?? sdk;

const plan = JSON.parse(process.argv[2]);
const client = new OpenAI({
  baseURL: process.env.MEMPROXY_BASE_URL,
  apiKey: process.env.MEMPROXY_KEY,
  defaultHeaders: { "X-Session-Id": process.env.MEMPROXY_SESSION },
  maxRetries: 0,
  timeout: 30_000,
});
const tools = [{
  type: "function",
  function: {
    name: "get_weather",
    description: "The weather in a city.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
}];

function getWeather(city) {
  return `${city}: 18C and sunny`;
}

const history = [{ role: "system", content: plan.system }];
let sent = 0; // how much of `history` the server has seen (a "new" client sends only the rest)
const replies = [];

async function ask(stream) {
  const messages = plan.history === "full" ? history : [history[0], ...history.slice(Math.max(sent, 1))];
  sent = history.length; // the tool-call echo is pushed after this: a "new" client sends it
  const params = { model: plan.model, messages, tools };
  const completion = stream
    ? await client.chat.completions.stream(params).finalChatCompletion()
    : await client.chat.completions.create(params);
  return completion.choices[0].message;
}

for (const turn of plan.turns) {
  history.push({ role: "user", content: turn.text });
  let message = await ask(turn.stream);
  while (message.tool_calls && message.tool_calls.length > 0) {
    history.push(message); // the echo, as the SDK returned it
    for (const call of message.tool_calls) {
      const { city } = JSON.parse(call.function.arguments);
      history.push({ role: "tool", tool_call_id: call.id, content: getWeather(city) });
    }
    message = await ask(turn.stream);
  }
  history.push(message);
  sent = history.length; // the answer came from the server: a "new" client never resends it
  replies.push(message.content);
}
process.stdout.write(JSON.stringify(replies) + "\n");
