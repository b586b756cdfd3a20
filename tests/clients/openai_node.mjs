// The official `openai` npm package as the scripts beside this one hold it: loaded from
// OPENAI_NODE_PREFIX, the npm prefix tests/test_clients.py installed it into (outside the repo, so it
// is resolved from there, not from this file), and a client of memproxy at MEMPROXY_BASE_URL with the
// key MEMPROXY_KEY on the session MEMPROXY_SESSION, retrying nothing. With MEMPROXY_AZURE set, the
// package's AzureOpenAI client, memproxy's address its endpoint: the model goes in the path as a
// deployment, the key in `api-key`.
import { createRequire } from "node:module";
import { join } from "node:path";

const require = createRequire(join(process.env.OPENAI_NODE_PREFIX, "package.json"));
const sdk = require("openai");
const OpenAI = sdk.OpenAI ?? sdk.default ?? sdk;

export function memproxyClient(headers = {}) {
  const options = {
    apiKey: process.env.MEMPROXY_KEY,
    defaultHeaders: { "X-Session-Id": process.env.MEMPROXY_SESSION, ...headers },
    maxRetries: 0,
    timeout: 30_000,
  };
  if (process.env.MEMPROXY_AZURE) {
    const endpoint = process.env.MEMPROXY_BASE_URL.replace(/\/v1$/, "");
    return new sdk.AzureOpenAI({ ...options, endpoint, apiVersion: "2024-10-21" });
  }
  return new OpenAI({ ...options, baseURL: process.env.MEMPROXY_BASE_URL });
}

// The tool both scripts offer, answered by `weatherIn`.
export const WEATHER = { name: "get_weather", description: "The weather in a city." };

export function weatherIn(city) {
  return `${city}: 18C and sunny`;
}
