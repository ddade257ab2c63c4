// The official OpenAI Node SDK against the router's OpenAI front, as a JavaScript app calls it.
// node openai_client.mjs BASE_URL MODEL  (the key comes from OPENAI_API_KEY)
// Prints one JSON object of what came back, for the Python test to check.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, maxRetries: 0 });
const messages = [{ role: "user", content: "Count from one to ten in words." }];
const request = { model, messages, max_tokens: 12, temperature: 0 };

const whole = await client.chat.completions.create(request);
let streamed = "";
let streamUsage = null;
const stream = await client.chat.completions.create({ ...request, stream: true, stream_options: { include_usage: true } });
for await (const chunk of stream) {
  if (chunk.usage) streamUsage = chunk.usage;
  for (const choice of chunk.choices) streamed += choice.delta?.content ?? "";
}
const choices = await client.chat.completions.create({ ...request, n: 2, temperature: 1, seed: 7 });
let refused = null;
try {
  await client.chat.completions.create({ ...request, temperature: 9 });
} catch (error) {
  refused = { name: error.constructor.name, status: error.status, param: error.param, code: error.code };
}
console.log(JSON.stringify({
  whole: whole.choices[0].message.content,
  finish: whole.choices[0].finish_reason,
  usage: whole.usage,
  streamed,
  streamUsage,
  choices: choices.choices.map((c) => [c.index, c.message.content]),
  refused,
}));
