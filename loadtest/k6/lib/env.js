// Settings from environment variables (k6 run -e NAME=value, or the shell's environment).
//
// A bad value stops the script in its init stage with one sentence naming the variable, so a
// typo in a long run's settings costs a second, not the run.

export function envString(name, fallback) {
  const value = __ENV[name];
  return value === undefined || value === '' ? fallback : value;
}

// A number from NAME, or `fallback` when unset; `min` and `integer` bound what is accepted.
export function envNumber(name, fallback, { min = 0, integer = false } = {}) {
  const raw = __ENV[name];
  if (raw === undefined || raw === '') return fallback;
  const value = Number(raw);
  if (!Number.isFinite(value) || value < min || (integer && !Number.isInteger(value))) {
    const kind = integer ? 'an integer' : 'a number';
    throw new Error(`${name} must be ${kind} >= ${min}, got "${raw}"`);
  }
  return value;
}

// A threshold limit: a number, `fallback` when unset, or null when set to "off" (no threshold).
export function envLimit(name, fallback) {
  if ((__ENV[name] || '').toLowerCase() === 'off') return null;
  return envNumber(name, fallback);
}

// "10:30s,50:2m,0:30s" -> [{target: 10, duration: '30s'}, ...] (ramping-arrival-rate stages).
export function envStages(name, fallback) {
  const raw = envString(name, fallback);
  return raw.split(',').map((part) => {
    const [target, duration, extra] = part.trim().split(':');
    const rate = Number(target);
    if (extra !== undefined || !duration || target === '' || !Number.isInteger(rate) || rate < 0) {
      throw new Error(`${name} must be a list like "10:30s,50:1m" (rate:duration, rate a whole number), got "${raw}"`);
    }
    return { target: rate, duration };
  });
}
