// A third-party gRPC-Web client for Sluicegate's system tests: Connect for Node.js
// (@connectrpc/connect-node's createGrpcWebTransport), with the service and messages built at run
// time from a FileDescriptorSet of proto/sluicegate/v1/inference.proto (protoc --descriptor_set_out),
// so there is no generated JavaScript to keep in step with the .proto.
//
//   node client.mjs DESCRIPTOR_SET CALLS_JSON
//
// CALLS_JSON is an array of calls, run one after another:
//   {"baseUrl", "httpVersion": "1.1"|"2", "method": "StreamChatCompletion"|"ChatCompletion",
//    "request": {proto JSON, snake_case or camelCase}, "headers": {...}, "timeoutMs": N,
//    "abortAfterChunks": N, "holdAfterAbort": true}
// For each call one JSON line on stdout:
//   {"code": 0 | gRPC code, "codeName", "message", "text", "chunks", "role", "finishReason", "usage",
//    "headers": {...}, "trailers": {...}, "aborted": bool}
// With holdAfterAbort the script prints "held" after the abort and waits until stdin closes before
// the next call, so a test can look at the gateway while this process (and its sockets) stay alive.

import { readFileSync } from "node:fs";
import { createFileRegistry, fromBinary, fromJson } from "@bufbuild/protobuf";
import { FileDescriptorSetSchema } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcWebTransport } from "@connectrpc/connect-node";

const [descriptorPath, callsJson] = process.argv.slice(2);
const registry = createFileRegistry(fromBinary(FileDescriptorSetSchema, readFileSync(descriptorPath)));
const service = registry.getService("sluicegate.v1.Inference");
const requestSchema = registry.getMessage("sluicegate.v1.ChatCompletionRequest");

function headersObject(headers) {
  const out = {};
  if (headers) headers.forEach((value, key) => { out[key] = value; });
  return out;
}

function waitForStdinEnd() {
  return new Promise((resolve) => {
    process.stdin.on("end", resolve);
    process.stdin.on("close", resolve);
    process.stdin.resume();
  });
}

async function run(call) {
  const transport = createGrpcWebTransport({
    baseUrl: call.baseUrl,
    httpVersion: call.httpVersion ?? "1.1",
    nodeOptions: call.httpVersion === "2" ? { rejectUnauthorized: false } : undefined,
  });
  const client = createClient(service, transport);
  const request = fromJson(requestSchema, call.request);
  const controller = new AbortController();
  const result = { code: 0, codeName: "OK", message: "", text: "", chunks: 0, aborted: false, headers: {}, trailers: {} };
  const options = {
    headers: call.headers ?? {},
    timeoutMs: call.timeoutMs,
    signal: controller.signal,
    onHeader: (h) => { result.headers = headersObject(h); },
    onTrailer: (t) => { result.trailers = headersObject(t); },
  };
  const take = (choices) => {
    for (const choice of choices) {
      if (choice.delta?.role) result.role = choice.delta.role;
      if (choice.delta?.content) result.text += choice.delta.content;
      if (choice.message?.role) result.role = choice.message.role;
      if (choice.message?.content) result.text += choice.message.content;
      if (choice.finishReason !== undefined) result.finishReason = choice.finishReason;
    }
  };
  try {
    if (call.method === "ChatCompletion") {
      const answer = await client.chatCompletion(request, options);
      result.chunks = 1;
      take(answer.choices);
      if (answer.usage) result.usage = { prompt: answer.usage.promptTokens, completion: answer.usage.completionTokens };
      result.id = answer.id;
    } else {
      for await (const chunk of client.streamChatCompletion(request, options)) {
        result.chunks += 1;
        result.id = chunk.id;
        take(chunk.choices);
        if (chunk.usage) result.usage = { prompt: chunk.usage.promptTokens, completion: chunk.usage.completionTokens };
        if (call.abortAfterChunks !== undefined && result.chunks >= call.abortAfterChunks) {
          result.aborted = true;
          controller.abort();
        }
      }
    }
  } catch (err) {
    const error = ConnectError.from(err);
    result.code = error.code;
    result.codeName = Code[error.code];
    result.message = error.rawMessage;
    result.metadata = headersObject(error.metadata);
  }
  process.stdout.write(JSON.stringify(result) + "\n");
  if (result.aborted && call.holdAfterAbort) {
    process.stdout.write("held\n");
    await waitForStdinEnd();
  }
}

for (const call of JSON.parse(callsJson)) {
  await run(call);
}
