// Ramping load: the arrival rate follows STAGES, e.g. up in steps to find where TTFT or goodput
// gives way, then back down to see whether the system recovers.
//
//   k6 run -e BASE_URL=... -e STAGES="5:30s,20:1m,50:1m,50:2m,0:30s" loadtest/k6/ramping.js
//
// STAGES is a list of rate:duration (requests per second reached at the end of each stage, linearly);
// START_RATE is the rate at the start.

import { envNumber, envStages } from './lib/env.js';
import { chat } from './lib/openai.js';
import { optionsFor, vuPool } from './lib/options.js';
import { summarize } from './lib/summary.js';

const startRate = envNumber('START_RATE', 1, { min: 0, integer: true });
const stages = envStages('STAGES', '5:30s,20:1m,40:1m,40:2m,0:30s');

export const options = optionsFor('ramping', {
  executor: 'ramping-arrival-rate',
  startRate,
  timeUnit: '1s',
  stages,
  ...vuPool(Math.max(startRate, ...stages.map((s) => s.target))),
});

export default function () {
  chat();
}

export function handleSummary(data) {
  return summarize(data, 'ramping');
}
