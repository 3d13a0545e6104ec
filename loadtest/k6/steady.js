// Steady load: a constant arrival rate (open model: requests start on schedule whether or not
// earlier ones have finished), for a baseline or a soak.
//
//   k6 run -e BASE_URL=http://127.0.0.1:8080 -e API_KEY=... -e RATE=10 -e DURATION=2m loadtest/k6/steady.js
//
// RATE requests per second for DURATION; every other setting is described in docs/load-testing.md.

import { envNumber, envString } from './lib/env.js';
import { chat } from './lib/openai.js';
import { optionsFor, vuPool } from './lib/options.js';
import { summarize } from './lib/summary.js';

const rate = envNumber('RATE', 10, { min: 1, integer: true });

export const options = optionsFor('steady', {
  executor: 'constant-arrival-rate',
  rate,
  timeUnit: '1s',
  duration: envString('DURATION', '1m'),
  ...vuPool(rate),
});

export default function () {
  chat();
}

export function handleSummary(data) {
  return summarize(data, 'steady');
}
