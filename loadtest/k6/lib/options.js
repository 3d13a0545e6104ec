// What every script shares besides the request and the summary: its thresholds (from the
// environment), the percentiles the summary keeps, and how many VUs an arrival rate may use.

import { envLimit, envNumber } from './env.js';

export const TREND_STATS = ['avg', 'min', 'med', 'p(90)', 'p(95)', 'p(99)', 'max', 'count'];

// Thresholds from the environment; any one set to "off" is left out. A failed threshold makes
// `k6 run` exit non-zero (99), which is what lets a CI job fail on it.
export function thresholds() {
  const limits = {
    ttft: ['TTFT_P95_MS', 2000, (v) => `p(95)<${v}`],
    tpot: ['TPOT_P95_MS', null, (v) => `p(95)<${v}`],
    e2e: ['E2E_P95_MS', null, (v) => `p(95)<${v}`],
    http_req_failed: ['FAILED_MAX', 0.01, (v) => `rate<${v}`],
    stream_ok: ['STREAM_OK_MIN', 0.99, (v) => `rate>=${v}`],
    dropped_iterations: ['DROPPED_MAX', 0, (v) => `count<=${v}`],
    goodput: ['GOODPUT_MIN', null, (v) => `rate>=${v}`],
  };
  const out = {};
  for (const [metric, [name, fallback, expression]] of Object.entries(limits)) {
    const value = envLimit(name, fallback);
    if (value !== null) out[metric] = [expression(value)];
  }
  return out;
}

// The options of a script whose load is the one `scenario` (an arrival-rate executor).
export function optionsFor(name, scenario) {
  return {
    scenarios: { [name]: scenario },
    thresholds: thresholds(),
    summaryTrendStats: TREND_STATS,
  };
}

// An arrival-rate executor starts each iteration on a free VU; with none free (all waiting on slow
// streams) and MAX_VUS reached, it drops the iteration. PRE_VUS are made before the test starts
// (making one mid-test takes time the schedule does not have); MAX_VUS bounds the streams in flight.
export function vuPool(peakRate) {
  const pre = envNumber('PRE_VUS', Math.max(10, Math.ceil(peakRate * 2)), { min: 1, integer: true });
  const max = envNumber('MAX_VUS', Math.max(pre, 500), { min: 1, integer: true });
  if (max < pre) throw new Error(`MAX_VUS (${max}) must be at least PRE_VUS (${pre})`);
  return { preAllocatedVUs: pre, maxVUs: max };
}
