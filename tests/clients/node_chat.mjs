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
import { WEATHER, memproxyClient, weatherIn } from "./openai_node.mjs";

const plan = JSON.parse(process.argv[2]);
const client = memproxyClient();
const tools = [{
  type: "function",
  function: {
    ...WEATHER,
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
}];

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
      history.push({ role: "tool", tool_call_id: call.id, content: weatherIn(city) });
    }
    message = await ask(turn.stream);
  }
  history.push(message);
  sent = history.length; // the answer came from the server: a "new" client never resends it
  replies.push(message.content);
}
process.stdout.write(JSON.stringify(replies) + "\n");
