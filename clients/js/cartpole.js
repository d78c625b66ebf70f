'use strict';
// A CartPole agent in JavaScript that trains a trustrl learner through its gateway.
//
//   trustrl agents add runs/cartpole js-1            # prints the token
//   trustrl serve CartPole-v1 --run-dir runs/cartpole --listen 127.0.0.1:50051
//   (cd clients/js && npm ci)
//   TRUSTRL_TOKEN=... node clients/js/cartpole.js grpc://127.0.0.1:50051 --seed 1
//
// Nothing of trustrl runs here: the gateway's three calls (trustrl/remote/proto/
// trustrl.proto, through @grpc/grpc-js) and the ONNX model Fetch hands out (through
// onnxruntime-node). The agent samples its actions from the model's `params` output (the
// log-probabilities), and sends thin chunks: the raw observations, its actions and the
// rewards; the learner computes the log-probabilities, values and statistics with the
// version that acted (docs/gateway.md). CartPole's physics are written out below, as in
// examples/external_cartpole.py. At the end it prints one line of JSON.

const path = require('path');
const grpc = require('@grpc/grpc-js');
const loader = require('@grpc/proto-loader');
const ort = require('onnxruntime-node');

const PROTO = path.join(__dirname, '..', '..', 'trustrl', 'remote', 'proto', 'trustrl.proto');
const [GRAVITY, CART_MASS, POLE_MASS, HALF_LENGTH, FORCE, TAU] = [9.8, 1.0, 0.1, 0.5, 10.0, 0.02];
const TOTAL_MASS = CART_MASS + POLE_MASS;
const POLE_MOMENT = POLE_MASS * HALF_LENGTH;
const [X_LIMIT, ANGLE_LIMIT, TIME_LIMIT] = [2.4, (12 * 2 * Math.PI) / 360, 500];

// A small seeded generator (mulberry32): runs with the same seed draw the same numbers.
function generator(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

class CartPole {
  constructor(random) {
    this.random = random;
    this.state = [0, 0, 0, 0];
    this.steps = 0;
  }

  reset() {
    this.state = this.state.map(() => this.random() * 0.1 - 0.05);
    this.steps = 0;
    return Float32Array.from(this.state);
  }

  step(action) {
    const [x, xDot, theta, thetaDot] = this.state;
    const force = action === 1 ? FORCE : -FORCE;
    const cos = Math.cos(theta);
    const sin = Math.sin(theta);
    const temp = (force + POLE_MOMENT * thetaDot * thetaDot * sin) / TOTAL_MASS;
    const thetaAcc =
      (GRAVITY * sin - cos * temp) / (HALF_LENGTH * (4 / 3 - (POLE_MASS * cos * cos) / TOTAL_MASS));
    const xAcc = temp - (POLE_MOMENT * thetaAcc * cos) / TOTAL_MASS;
    this.state = [x + TAU * xDot, xDot + TAU * xAcc, theta + TAU * thetaDot, thetaDot + TAU * thetaAcc];
    this.steps += 1;
    const terminated = Math.abs(this.state[0]) > X_LIMIT || Math.abs(this.state[2]) > ANGLE_LIMIT;
    const truncated = this.steps >= TIME_LIMIT && !terminated;
    return [Float32Array.from(this.state), 1.0, terminated, truncated];
  }
}

function gateway(url, token) {
  const definition = loader.loadSync(PROTO, {
    keepCase: true, // the .proto's field names, as the docs give them
    longs: Number,
    enums: String,
    defaults: true,
  });
  const { Gateway } = grpc.loadPackageDefinition(definition).trustrl.gateway.v1;
  const client = new Gateway(url.replace(/^grpc:\/\//, ''), grpc.credentials.createInsecure(), {
    'grpc.max_receive_message_length': 1 << 30,
    'grpc.max_reconnect_backoff_ms': 5000,
  });
  const metadata = new grpc.Metadata();
  metadata.set('authorization', `Bearer ${token}`);
  const call = (name, request, seconds) =>
    new Promise((resolve, reject) => {
      const deadline = new Date(Date.now() + seconds * 1000);
      client[name](request, metadata, { deadline }, (error, reply) =>
        error ? reject(error) : resolve(reply),
      );
    });
  return { call, close: () => client.close() };
}

// An Array message: little-endian bytes (this machine's order) with a dtype and a shape.
function array(dtype, shape, typed) {
  return { dtype, shape, data: Buffer.from(typed.buffer, typed.byteOffset, typed.byteLength) };
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function parse(argv) {
  const options = { url: argv[0], seed: 1, seconds: 600, pace: 2 };
  for (let i = 1; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, '');
    if (!(key in options)) throw new Error(`unknown option ${argv[i]}`);
    options[key] = Number(argv[i + 1]);
  }
  if (!options.url || !options.url.startsWith('grpc://')) {
    throw new Error('usage: node cartpole.js grpc://HOST:PORT [--seed N] [--seconds S] [--pace MS]');
  }
  return options;
}

async function main() {
  const options = parse(process.argv.slice(2));
  const token = process.env.TRUSTRL_TOKEN;
  if (!token) throw new Error('set TRUSTRL_TOKEN to the token of `trustrl agents add`');
  const link = gateway(options.url, token);
  const status = await link.call('Status', {}, 60);
  const maxChunk = JSON.parse(status.learner_json).max_chunk_length;
  const random = generator(options.seed);
  const source = `js-${options.seed}-${Date.now()}`;
  const counts = { ACCEPTED: 0, STALE: 0, RETRY: 0, REFUSED: 0, errors: 0 };
  let policy = { version: -1, session: null };
  let finished = false;
  let stopped = false;
  let lastError = '';

  // The watcher: a long poll for each new version, with its ONNX model.
  const watching = (async () => {
    while (!stopped) {
      try {
        const reply = await link.call('Fetch', { have: policy.version, wait_seconds: 5, onnx: true }, 15);
        finished = reply.finished;
        if (reply.policy && reply.version > policy.version) {
          const session = await ort.InferenceSession.create(reply.policy.onnx);
          policy = { version: reply.version, session };
        }
        if (finished) return;
      } catch (error) {
        counts.errors += 1;
        lastError = String(error.details || error);
        await sleep(500);
      }
    }
  })();

  // The shipper: sends what is queued, in order; keeps what was not taken.
  const queue = [];
  const shipping = (async () => {
    while (!(stopped && queue.length === 0)) {
      if (queue.length === 0) {
        await sleep(5);
        continue;
      }
      const batch = queue.slice(0, 64);
      try {
        const reply = await link.call('Submit', { chunks: batch }, 10);
        let taken = 0;
        for (const result of reply.results) {
          if (result.outcome === 'RETRY') break; // this one and the rest: later
          counts[result.outcome] += 1;
          if (result.outcome === 'REFUSED') lastError = `${result.reason}: ${result.error}`;
          taken += 1;
        }
        counts.RETRY += batch.length - taken;
        queue.splice(0, taken);
        if (reply.slow_down_seconds > 0) await sleep(reply.slow_down_seconds * 1000);
      } catch (error) {
        counts.errors += 1;
        lastError = String(error.details || error);
        if (stopped) return; // the learner is gone at the end: what is left stays unsent
        await sleep(500);
      }
    }
  })();

  while (policy.session === null) await sleep(20);
  const env = new CartPole(random);
  const started = Date.now();
  let steps = 0;
  let episodes = 0;
  let obs = env.reset();
  let chunk = null;
  let seq = 0; // (source, seq) names each chunk: one sent again is recognized
  const ship = (ending, last) => {
    const rows = ending === 'terminated' ? chunk.obs : [...chunk.obs, last];
    const flat = new Float32Array(rows.length * 4);
    rows.forEach((row, i) => flat.set(row, i * 4));
    queue.push({
      agent: '',
      source,
      seq: chunk.seq,
      version: chunk.version,
      ending,
      obs: array('float32', [rows.length, 4], flat),
      actions: array('int64', [chunk.actions.length], BigInt64Array.from(chunk.actions, BigInt)),
      rewards: array('float32', [chunk.rewards.length], Float32Array.from(chunk.rewards)),
    });
    chunk = null;
  };
  while (!finished && Date.now() - started < options.seconds * 1000) {
    if (chunk === null) {
      // A chunk is acted by one version: the newest, when it begins.
      chunk = { version: policy.version, session: policy.session, seq, obs: [], actions: [], rewards: [] };
      seq += 1;
    }
    if (options.pace > 0) await sleep(options.pace); // the application's own clock
    const output = await chunk.session.run({ obs: new ort.Tensor('float32', obs, [1, 4]) });
    const probability = Math.exp(output.params.data[0]); // log-probabilities of 0 and 1
    const action = random() < probability ? 0 : 1;
    const [next, reward, terminated, truncated] = env.step(action);
    chunk.obs.push(obs);
    chunk.actions.push(action);
    chunk.rewards.push(reward);
    steps += 1;
    if (terminated || truncated) {
      ship(terminated ? 'terminated' : 'truncated', next);
      episodes += 1;
      obs = env.reset();
    } else {
      obs = next;
      if (chunk.actions.length >= maxChunk) ship('cut', obs);
    }
  }
  const flushBy = Date.now() + 10000;
  while (queue.length > 0 && Date.now() < flushBy && !finished) await sleep(20);
  stopped = true;
  await Promise.race([Promise.all([watching, shipping]), sleep(10000)]);
  link.close();
  const seconds = (Date.now() - started) / 1000;
  const result = { steps, episodes, seconds, chunks: seq, ...counts, queued: queue.length };
  console.log(JSON.stringify({ ...result, version: policy.version, finished, last_error: lastError }));
  process.exit(0);
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
