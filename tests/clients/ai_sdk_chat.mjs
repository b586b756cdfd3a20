// One conversation held by the Vercel AI SDK (`ai` and `@ai-sdk/openai`), driven by tests/test_clients.py.
//
// argv[2]: the plan, as JSON: {"api": "chat" | "responses", "history": "ui" | "full" | "new", "system": str,
// "model": str, "turns": [{"text", "stream"}]}.
// Environment: MEMPROXY_BASE_URL, MEMPROXY_KEY, MEMPROXY_SESSION, and AI_SDK_PREFIX, the npm prefix the test
// installed the packages into (outside the repo, so they are resolved from there, not from this file).
//
// The provider is `createOpenAI` with the session id as a header; "chat" is `openai.chat(model)` (chat
// completions), "responses" the default `openai(model)` (the Responses API). Each turn is one
// `generateText` or `streamText` call with the system prompt, a `get_weather` tool the SDK executes itself
// and `stopWhen: stepCountIs(5)`, so a tool call and its answer are two steps of one call, and 24-hour
// prompt caching (`promptCacheRetention`). The history:
// - "ui": what `useChat` does: the app keeps UI messages, read from `toUIMessageStream()` as the hook
//   reads its route's stream, and its route sends them all, `convertToModelMessages`, on every turn;
// - "full": the model messages, each turn's `response.messages` appended (the AI SDK's own docs' way);
// - "new": the new user message alone (the proxy remembers the rest).
// For each turn it prints the text, each step's finish reason and warnings, the errors a stream reported,
// the response id, the tool results and the usage of all steps, as JSON on stdout.
import { createRequire } from "node:module";
import { join } from "node:path";

const require = createRequire(join(process.env.AI_SDK_PREFIX, "package.json"));
const { generateText, streamText, tool, stepCountIs, convertToModelMessages, readUIMessageStream } =
  require("ai");
const { createOpenAI } = require("@ai-sdk/openai");
const { z } = require("zod");

const plan = JSON.parse(process.argv[2]);
const openai = createOpenAI({
  baseURL: process.env.MEMPROXY_BASE_URL,
  apiKey: process.env.MEMPROXY_KEY,
  headers: { "X-Session-Id": process.env.MEMPROXY_SESSION },
});
const model = plan.api === "chat" ? openai.chat(plan.model) : openai(plan.model);
const tools = {
  get_weather: tool({
    description: "The weather in a city.",
    inputSchema: z.object({ city: z.string() }),
    execute: async ({ city }) => `${city}: 18C and sunny`,
  }),
};

const errors = []; // what a stream reported (the SDK's schema refusing an event, ...) rather than threw
let history = []; // model messages ("full"), or UI messages ("ui")
const turns = [];

for (const turn of plan.turns) {
  const user = { role: "user", content: turn.text };
  let messages;
  if (plan.history === "ui") {
    history.push({ id: `user-${turns.length}`, role: "user", parts: [{ type: "text", text: turn.text }] });
    messages = await convertToModelMessages(history, { tools });
  } else {
    messages = plan.history === "full" ? [...history, user] : [user];
  }
  const call = {
    model, system: plan.system, messages, tools, stopWhen: stepCountIs(5), maxRetries: 0,
    providerOptions: { openai: { promptCacheRetention: "24h" } },
  };
  let text, steps, usage, response;
  if (turn.stream) {
    const result = streamText({ ...call, onError: ({ error }) => { errors.push(String(error)); } });
    if (plan.history === "ui") {
      let answer;
      for await (const message of readUIMessageStream({ stream: result.toUIMessageStream() })) {
        answer = message;
      }
      history.push(answer);
    }
    [text, steps, usage, response] = await Promise.all([result.text, result.steps, result.totalUsage,
                                                        result.response]);
  } else {
    if (plan.history === "ui") {
      throw new Error("useChat streams every turn");
    }
    ({ text, steps, totalUsage: usage, response } = await generateText(call));
  }
  if (plan.history === "full") {
    history = [...messages, ...response.messages];
  }
  turns.push({
    text,
    finishReasons: steps.map((step) => step.finishReason),
    warnings: steps.flatMap((step) => step.warnings ?? []),
    errors: errors.splice(0),
    responseId: response.id,
    toolResults: steps.flatMap((step) => step.toolResults.map(({ toolName, input, output }) => ({
      toolName, input, output,
    }))),
    usage: { inputTokens: usage.inputTokens, outputTokens: usage.outputTokens, totalTokens: usage.totalTokens },
  });
}
process.stdout.write(JSON.stringify(turns) + "\n");
