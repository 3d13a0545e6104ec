// Spike: a base rate, a sudden jump to SPIKE_RATE, and the base rate again, to see the queueing
// (TTFT) during the spike and how fast it drains after.
//
//   k6 run -e BASE_URL=... -e BASE_RATE=5 -e SPIKE_RATE=60 loadtest/k6/spike.js
//
// BASE_RATE for BASE_DURATION, up to SPIKE_RATE within SPIKE_RAMP, held for SPIKE_DURATION, down
// within SPIKE_RAMP, then BASE_RATE for BASE_DURATION again.

import { envNumber, envString } from './lib/env.js';
import { chat } from './lib/openai.js';
import { optionsFor, vuPool } from './lib/options.js';
import { summarize } from './lib/summary.js';

const baseRate = envNumber('BASE_RATE', 5, { min: 0, integer: true });
const spikeRate = envNumber('SPIKE_RATE', 50, { min: 1, integer: true });
const baseDuration = envString('BASE_DURATION', '1m');
const ramp = envString('SPIKE_RAMP', '5s');

export const options = optionsFor('spike', {
  executor: 'ramping-arrival-rate',
  startRate: baseRate,
  timeUnit: '1s',
  stages: [
    { target: baseRate, duration: baseDuration },
    { target: spikeRate, duration: ramp },
    { target: spikeRate, duration: envString('SPIKE_DURATION', '30s') },
    { target: baseRate, duration: ramp },
    { target: baseRate, duration: baseDuration },
  ],
  ...vuPool(Math.max(baseRate, spikeRate)),
});

export default function () {
  chat();
}

export function handleSummary(data) {
  return summarize(data, 'spike');
}
