// The Vercel AI SDK's tools against an OpenAI-compatible server, as an app writes them:
//   node ai_sdk_tools.mjs BASE_URL MODEL
// prints the first call's finish reason, text and tool calls, then a tool-result turn's, as JSON.
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateText, jsonSchema, tool } from "ai";

const [baseURL, model] = process.argv.slice(2);
const provider = createOpenAICompatible({ name: "neuronpy", baseURL, apiKey: "unused" });
const tools = {
  get_weather: tool({
    description: "Weather in a city",
    inputSchema: jsonSchema({
      type: "object",
      properties: { city: { type: "string", maxLength: 12 } },
      required: ["city"],
    }),
  }),
};
const first = await generateText({
  model: provider(model),
  prompt: "Weather in Paris?",
  maxOutputTokens: 16,
  maxRetries: 0,
  tools,
});
const second = await generateText({
  model: provider(model),
  maxOutputTokens: 8,
  maxRetries: 0,
  tools,
  messages: [
    { role: "user", content: "Weather in Paris?" },
    {
      role: "assistant",
      content: [
        { type: "tool-call", toolCallId: "c1", toolName: "get_weather", input: { city: "Paris" } },
      ],
    },
    {
      role: "tool",
      content: [
        {
          type: "tool-result",
          toolCallId: "c1",
          toolName: "get_weather",
          output: { type: "text", value: "18 C" },
        },
      ],
    },
  ],
});
const summary = (r) => ({
  finishReason: r.finishReason,
  text: r.text,
  toolCalls: r.toolCalls.map((c) => ({ name: c.toolName, input: c.input })),
  inputTokens: r.usage.inputTokens,
});
console.log(JSON.stringify({ first: summary(first), second: summary(second) }));
