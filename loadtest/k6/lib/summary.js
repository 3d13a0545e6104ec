// The end-of-test summary of every script: JSON for machines, text for people.
//
// dropped_iterations and the counters of this project's metrics appear in the summary even when
// nothing was counted: "0 dropped" is the statement that the generator kept its arrival rate, and
// a missing line would leave the reader guessing.

import { envString } from './env.js';
import { promptSource, settings } from './openai.js';

const ALWAYS_SHOWN = {
  dropped_iterations: 'counter',
  output_tokens: 'counter',
  token_mismatch: 'counter',
  goodput_ok: 'counter',
};

function withZeros(metrics) {
  const out = { ...metrics };
  for (const [name, type] of Object.entries(ALWAYS_SHOWN)) {
    if (!out[name]) out[name] = { type, contains: 'default', values: { count: 0, rate: 0 } };
  }
  return out;
}

function ms(value) {
  if (value === undefined || value === null) return '-';
  return value >= 1000 ? `${(value / 1000).toFixed(2)}s` : `${value.toFixed(2)}ms`;
}

function trendLine(label, metric) {
  if (!metric) return `  ${label.padEnd(16)} (no samples)`;
  const v = metric.values;
  const stats = ['avg', 'med', 'p(90)', 'p(95)', 'p(99)', 'max'].map((k) => `${k}=${ms(v[k])}`).join(' ');
  return `  ${label.padEnd(16)} ${stats}  n=${v.count}`;
}

function count(metrics, name) {
  return metrics[name] ? metrics[name].values.count : 0;
}

function perSecond(metrics, name) {
  return metrics[name] ? metrics[name].values.rate.toFixed(2) : '0.00';
}

function percent(metrics, name) {
  return metrics[name] ? `${(metrics[name].values.rate * 100).toFixed(2)}%` : '-';
}

export function textSummary(data, script) {
  const m = data.metrics;
  const seconds = (data.state.testRunDurationMs / 1000).toFixed(1);
  const lines = [
    '',
    `k6 ${script}: ${settings.baseUrl}, model ${settings.model}, max_tokens ${settings.maxTokens || 'per prompt'},`
      + ` prompts ${promptSource}, ${seconds}s`,
    `  requests         ${count(m, 'http_reqs')} (${perSecond(m, 'http_reqs')}/s), failed ${percent(m, 'http_req_failed')},`
      + ` complete streams ${percent(m, 'stream_ok')}`,
    `  iterations       ${count(m, 'iterations')}, dropped ${count(m, 'dropped_iterations')}`
      + ' (dropped > 0: the arrival rate was not kept, see docs/load-testing.md)',
    trendLine('ttft', m.ttft),
    trendLine('tpot', m.tpot),
    trendLine('e2e', m.e2e),
    `  output_tokens    ${count(m, 'output_tokens')} (${perSecond(m, 'output_tokens')}/s),`
      + ` token_mismatch ${count(m, 'token_mismatch')}`,
    `  goodput          ${count(m, 'goodput_ok')} requests (${perSecond(m, 'goodput_ok')}/s), ${percent(m, 'goodput')}`
      + ` of requests met ttft<=${settings.targetTtftMs}ms tpot<=${settings.targetTpotMs}ms e2e<=${settings.targetE2eMs}ms`,
    'thresholds',
  ];
  for (const [name, metric] of Object.entries(m)) {
    for (const [expression, verdict] of Object.entries(metric.thresholds || {})) {
      lines.push(`  ${verdict.ok ? 'ok  ' : 'FAIL'} ${name} ${expression}`);
    }
  }
  return `${lines.join('\n')}\n`;
}

// handleSummary for a script: the text on stdout, the whole summary as JSON in SUMMARY_JSON.
export function summarize(data, script) {
  const full = { ...data, metrics: withZeros(data.metrics), script, prompts: promptSource };
  const out = { stdout: textSummary(full, script) };
  const path = envString('SUMMARY_JSON', `k6-${script}-summary.json`);
  if (path.toLowerCase() !== 'off') out[path] = JSON.stringify(full, null, 2);
  return out;
}
