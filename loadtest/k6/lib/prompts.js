// The prompts the scripts send: the shared set under loadtest/prompts/ when there is one (the same
// prompts Sluicegate's own load generator sends, so the tools can be compared on one load), a file
// named by PROMPTS_FILE, or else a small list embedded here.
//
// A file is JSON (an array) or JSON Lines; each entry is a string, or an object with `messages`
// (chat messages), or `prompt` / `text` (one user message), and optionally `max_tokens` /
// `output_tokens` (used when MAX_TOKENS is not set).

import { envString } from './env.js';

const SHARED = ['synthetic.jsonl']; // in loadtest/prompts/, written by make_prompts.py

const EMBEDDED = [
  'Explain in two sentences what a sluice gate does.',
  'Write a haiku about a queue of requests waiting for a GPU.',
  'List three reasons a streaming API might hold its response headers until the first token.',
  'Summarise the difference between throughput and latency for a web service.',
  'Translate "the water is rising" into French, German and Spanish.',
  'Describe the steps to replace a bicycle tyre, briefly.',
  'What is tail latency, and why does the 99th percentile matter more than the mean?',
  'Give a short recipe for lentil soup.',
];

function entry(item, where) {
  if (typeof item === 'string') return { messages: [{ role: 'user', content: item }], maxTokens: null };
  if (item && typeof item === 'object') {
    const maxTokens = Number.isInteger(item.max_tokens) ? item.max_tokens
      : Number.isInteger(item.output_tokens) ? item.output_tokens : null;
    if (Array.isArray(item.messages)) return { messages: item.messages, maxTokens };
    const text = typeof item.prompt === 'string' ? item.prompt : item.text;
    if (typeof text === 'string') return { messages: [{ role: 'user', content: text }], maxTokens };
  }
  throw new Error(`${where}: each prompt must be a string or an object with "messages", "prompt" or "text"`);
}

function parse(text, where) {
  const trimmed = text.trim();
  let items;
  try {
    items = trimmed.startsWith('[') ? JSON.parse(trimmed)
      : trimmed.split('\n').filter((line) => line.trim() !== '').map((line) => JSON.parse(line));
  } catch (err) {
    throw new Error(`${where} is neither a JSON array nor JSON Lines: ${err.message}`);
  }
  if (!Array.isArray(items) || items.length === 0) throw new Error(`${where} holds no prompts`);
  return items.map((item) => entry(item, where));
}

function read(path) {
  try {
    return open(path);
  } catch (_err) {
    return null;
  }
}

// Runs in the init context (k6's open() works only there). `source` says where the prompts came from.
export function loadPrompts() {
  const named = envString('PROMPTS_FILE', '');
  if (named) {
    const path = named.startsWith('/') ? named : import.meta.resolve(`../${named}`);
    const text = read(path);
    if (text === null) throw new Error(`PROMPTS_FILE ${named} cannot be read (give an absolute path, or one relative to loadtest/k6/)`);
    return { prompts: parse(text, named), source: named };
  }
  for (const name of SHARED) {
    const text = read(import.meta.resolve(`../../prompts/${name}`));
    if (text !== null) return { prompts: parse(text, `loadtest/prompts/${name}`), source: `loadtest/prompts/${name}` };
  }
  return { prompts: EMBEDDED.map((p) => entry(p, 'embedded')), source: 'embedded' };
}
