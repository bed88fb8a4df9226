// Keuss's side of `make bench-peers`: the scenarios of aio-keuss's `python -m bench`, with
// Keuss's own API (https://pepmartinez.github.io/keuss/docs/): a factory per backend,
// queue.push, queue.pop, and queue.pop with {reserve: true} followed by queue.ok.
// Concurrency is N loops in one process, each waiting for its call before the next one,
// like aio-keuss's N client tasks. One JSON row per measurement goes to stdout.
//
// usage: node keuss_bench.js --backend redis-oq --clients 3,32 --messages 20000
'use strict';

const crypto = require('crypto');
const { promisify } = require('util');

const REDIS = { host: '127.0.0.1', port: 6379, db: 0 };
const SCHEMA = 'akpeers_keuss';
const POSTGRES = {
  host: '127.0.0.1', port: 5432, user: 'postgres', password: '', database: 'test',
  options: `-c search_path=${SCHEMA}`,
};
// The same payload as aio-keuss's bench, so both sides move the same bytes.
const PAYLOAD = { id: 0, user: 'someone@example.com', items: [1, 2, 3], note: 'x'.repeat(120) };

function parseArgs(argv) {
  const args = { backend: 'redis-oq', clients: '3,32', messages: 20000 };
  for (let i = 0; i < argv.length; i += 2) {
    const name = argv[i].replace(/^--/, '');
    if (!(name in args)) throw new Error(`unknown option ${argv[i]}`);
    args[name] = argv[i + 1];
  }
  args.clients = String(args.clients).split(',').map(Number);
  args.messages = Number(args.messages);
  return args;
}

async function makeFactory(backend) {
  if (backend === 'postgres') {
    // Keuss names its tables _k_tbl_<queue> in the search path: give them a schema of their own.
    const pg = require('pg');
    const client = new pg.Client({ ...POSTGRES, options: undefined });
    await client.connect();
    await client.query(`CREATE SCHEMA IF NOT EXISTS ${SCHEMA}`);
    await client.end();
  }
  const creator = require(`keuss/backends/${backend}`);
  const opts = backend === 'postgres' ? { postgres: POSTGRES } : { redis: REDIS };
  return promisify(creator)(opts);
}

async function cleanUp(backend, names) {
  if (backend === 'postgres') {
    const pg = require('pg');
    const client = new pg.Client({ ...POSTGRES, options: undefined });
    await client.connect();
    await client.query(`DROP SCHEMA IF EXISTS ${SCHEMA} CASCADE`);
    await client.end();
    return;
  }
  const Redis = require('ioredis');
  const redis = new Redis(REDIS);
  const keys = names.flatMap((n) => [
    `keuss:q:list:${n}`, `keuss:q:ordered_queue:hash:${n}`, `keuss:q:ordered_queue:index:${n}`,
  ]);
  if (keys.length) await redis.del(...keys);
  await redis.quit();
}

// Split `total` over `clients` loops; each runs `step` once per message it owns.
async function runClients(clients, total, step) {
  const shares = Array.from({ length: clients },
    (_, i) => Math.floor(total / clients) + (i < total % clients ? 1 : 0));
  const start = process.hrtime.bigint();
  await Promise.all(shares.map(async (share, client) => {
    for (let i = 0; i < share; i++) await step(client);
  }));
  return Number(process.hrtime.bigint() - start) / 1e9;
}

function popOnce(q, client, reserve) {
  return new Promise((resolve, reject) => {
    q.pop(`c${client}`, { reserve, timeout: 10000 }, (err, item) => {
      if (err) reject(new Error(`pop failed: ${JSON.stringify(err)}`));
      else resolve(item);
    });
  });
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const factory = await makeFactory(args.backend);
  const reserve = factory.capabilities().reserve;
  const run = crypto.randomBytes(3).toString('hex');
  const names = [];
  const fresh = async () => {
    const name = `akpeers_${run}_${names.length + 1}`;
    names.push(name);
    return promisify((cb) => factory.queue(name, {}, cb))();
  };
  const emit = (scenario, clients, seconds) => console.log(JSON.stringify({
    system: 'keuss', backend: args.backend, scenario, clients, messages: args.messages,
    seconds: Math.round(seconds * 1000) / 1000, rate: Math.round(args.messages / seconds),
  }));
  try {
    for (const clients of args.clients) {
      let q = await fresh();
      const push = promisify(q.push.bind(q));
      emit('push', clients, await runClients(clients, args.messages, () => push(PAYLOAD)));
      emit('pop', clients, await runClients(clients, args.messages, (c) => popOnce(q, c, false)));
      if (!reserve) continue;
      q = await fresh();
      const fill = promisify(q.push.bind(q));
      await runClients(clients, args.messages, () => fill(PAYLOAD)); // untimed: Keuss has no bulk push
      const ok = promisify(q.ok.bind(q));
      const seconds = await runClients(clients, args.messages, async (c) => {
        const item = await popOnce(q, c, true);
        if (!(await ok(item))) throw new Error('ok failed');
      });
      emit('reserve+ok', clients, seconds);
    }
  } finally {
    await promisify(factory.close.bind(factory))();
    await cleanUp(args.backend, names);
  }
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
