// One streaming chat completion against an OpenAI-compatible endpoint, and the LLM metrics k6
// does not have: time to first token, time per output token, end-to-end latency, output tokens
// and goodput.
//
// Core k6 buffers a response body and hands it over only once complete, so nothing here sees a
// token arrive. What the timings do give:
//   ttft = res.timings.waiting, the time from the request's last byte to the response's first.
//     Sluicegate holds its status line until the first content token has arrived (role-only
//     chunks and keep-alive comments are buffered), so through Sluicegate this IS the time to first
//     token. A server that sends its headers (or a role-only chunk) at once makes it the time to
//     first byte instead, which is much smaller than TTFT: do not compare the two.
//   e2e  = res.timings.duration (sending + waiting + receiving; connecting is http_req_connecting).
//   tpot = (e2e - ttft) / (output_tokens - 1).
// Output tokens are the server's `usage.completion_tokens` (asked for with
// stream_options.include_usage); a count that differs from the content events seen adds one to
// `token_mismatch`.

import http from 'k6/http';
import exec from 'k6/execution';
import { check } from 'k6';
import { Counter, Rate, Trend } from 'k6/metrics';

import { envNumber, envString } from './env.js';
import { loadPrompts } from './prompts.js';

export const ttft = new Trend('ttft', true);
export const tpot = new Trend('tpot', true);
export const e2e = new Trend('e2e', true);
export const outputTokens = new Counter('output_tokens');
export const tokenMismatch = new Counter('token_mismatch');
export const goodputOk = new Counter('goodput_ok');
export const goodput = new Rate('goodput');
export const streamOk = new Rate('stream_ok');

// Read once per VU, in the init context.
export const settings = {
  baseUrl: envString('BASE_URL', 'http://127.0.0.1:8080').replace(/\/+$/, ''),
  apiKey: envString('API_KEY', ''),
  model: envString('MODEL', 'llama-8b'),
  maxTokens: envNumber('MAX_TOKENS', null, { min: 1, integer: true }),
  timeout: envString('REQUEST_TIMEOUT', '120s'),
  // Goodput targets (milliseconds): a request counts only if it meets all three.
  targetTtftMs: envNumber('TARGET_TTFT_MS', 1000),
  targetTpotMs: envNumber('TARGET_TPOT_MS', 100),
  targetE2eMs: envNumber('TARGET_E2E_MS', 30000),
};

const { prompts, source: promptSource } = loadPrompts();
export { promptSource };

const DEFAULT_MAX_TOKENS = 64;

function textOf(delta) {
  if (!delta) return '';
  return delta.content || delta.reasoning_content || delta.reasoning || '';
}

// The events of a complete SSE body: content-carrying events, the usage object, [DONE], errors.
export function parseStream(body) {
  const seen = { contentEvents: 0, usage: null, done: false, error: null };
  for (const block of body.split(/\r?\n\r?\n/)) {
    const data = block.split(/\r?\n/).filter((line) => line.startsWith('data:'))
      .map((line) => line.slice(5).trimStart()).join('\n');
    if (data === '') continue;
    if (data === '[DONE]') {
      seen.done = true;
      continue;
    }
    let event;
    try {
      event = JSON.parse(data);
    } catch (_err) {
      seen.error = seen.error || 'an event that is not JSON';
      continue;
    }
    if (event.error) seen.error = seen.error || JSON.stringify(event.error);
    if (event.usage && Number.isInteger(event.usage.completion_tokens)) seen.usage = event.usage;
    for (const choice of event.choices || []) {
      if (textOf(choice.delta) !== '') seen.contentEvents += 1;
    }
  }
  return seen;
}

// One request: the prompt set round-robin over the whole test, so every run sends the same sequence.
export function chat() {
  const prompt = prompts[exec.scenario.iterationInTest % prompts.length];
  const maxTokens = settings.maxTokens || prompt.maxTokens || DEFAULT_MAX_TOKENS;
  const headers = { 'Content-Type': 'application/json' };
  if (settings.apiKey) headers.Authorization = `Bearer ${settings.apiKey}`;
  const body = JSON.stringify({
    model: settings.model,
    messages: prompt.messages,
    max_tokens: maxTokens,
    stream: true,
    stream_options: { include_usage: true },
  });
  const res = http.post(`${settings.baseUrl}/v1/chat/completions`, body, {
    headers,
    timeout: settings.timeout,
    responseType: 'text',
    tags: { name: 'chat.completions' },
  });
  record(res);
  return res;
}

function record(res) {
  const seen = res.status === 200 && typeof res.body === 'string' ? parseStream(res.body) : null;
  const tokens = seen ? (seen.usage ? seen.usage.completion_tokens : seen.contentEvents) : 0;
  const complete = seen !== null && seen.done && seen.error === null && seen.contentEvents > 0;
  check(res, {
    'status is 200': (r) => r.status === 200,
    'stream complete ([DONE], no error event)': () => complete,
    'usage reported': () => seen !== null && seen.usage !== null,
  });
  streamOk.add(complete);
  if (!complete) {
    goodput.add(false);
    return;
  }
  if (seen.usage && seen.usage.completion_tokens !== seen.contentEvents) tokenMismatch.add(1);
  const first = res.timings.waiting;
  const total = res.timings.duration;
  ttft.add(first);
  e2e.add(total);
  outputTokens.add(tokens);
  let perToken = null;
  if (tokens > 1) {
    perToken = (total - first) / (tokens - 1);
    tpot.add(perToken);
  }
  const good = first <= settings.targetTtftMs && total <= settings.targetE2eMs
    && (perToken === null || perToken <= settings.targetTpotMs);
  goodput.add(good);
  if (good) goodputOk.add(1);
}
