// kafkajs worker for hyperkafka's compatibility tests.
//
// Owns the kafkajs side of a round trip: `node worker.js produce|consume --bootstrap H:P
// --topic T [--partition 0] [--codec none|gzip] [--infile F] [--outfile F] [--count N]
// [--offset O] [--timeout S] [--chunk N] [--allow-errors] [--idempotence on|off]
// [--auto-create] [--spec JSON (TLS/SASL)]`. Records come and go as the JSON
// lines described in compat_tests/records.py. Prints one JSON summary line on stdout; exits
// non-zero on error. A produce sends --chunk records (500) per send(), which kafkajs puts in
// one batch; with --allow-errors it reports what the broker refused, {"n": delivered,
// "error_codes": {code: count}, "errors": ["KafkaJSProtocolError MESSAGE_TOO_LARGE: ..."]},
// instead of failing.
//
// kafkajs has no assign-mode consumer (its Consumer always joins a group), and groups come
// later in hyperkafka; so `consume` drives kafkajs's own Cluster/Broker classes: its real
// Metadata, ListOffsets and Fetch encoders and its record-batch decoder, minus the group.
'use strict'

const fs = require('fs')
const { Kafka, CompressionTypes, logLevel } = require('kafkajs')

function parseArgs(argv) {
  const args = { partition: 0, codec: 'none', count: 0, offset: 0, timeout: 120, idle: 20, chunk: 500 }
  args.action = argv[0]
  for (let i = 1; i < argv.length; i++) {
    const name = argv[i].replace(/^--/, '')
    if (i + 1 < argv.length && !argv[i + 1].startsWith('--')) args[name] = argv[++i]
    else args[name] = true // a flag without a value
  }
  for (const n of ['partition', 'count', 'offset', 'timeout', 'idle', 'chunk']) args[n] = Number(args[n])
  return args
}

const b64 = s => (s === null || s === undefined ? null : Buffer.from(s, 'base64'))
const unb64 = b => (b === null || b === undefined ? null : Buffer.from(b).toString('base64'))

function readRecords(path) {
  return fs
    .readFileSync(path, 'ascii')
    .split('\n')
    .filter(line => line.trim())
    .map(line => JSON.parse(line))
}

function toMessage(rec, partition) {
  const msg = { key: b64(rec.k), value: b64(rec.v), partition }
  if (rec.h && rec.h.length) {
    msg.headers = {}
    for (const [name, value] of rec.h) {
      if (Object.prototype.hasOwnProperty.call(msg.headers, name)) {
        throw new Error(`kafkajs profile must not use duplicate header names (${name})`)
      }
      msg.headers[name] = b64(value)
    }
  }
  if (rec.ts !== null && rec.ts !== undefined) msg.timestamp = String(rec.ts)
  return msg
}

async function produce(kafka, args) {
  const records = readRecords(args.infile)
  // Not idempotent unless asked (kafkajs's default); idempotence needs one request in flight.
  const idempotent = args.idempotence === 'on'
  const producer = kafka.producer({
    allowAutoTopicCreation: Boolean(args['auto-create']),
    idempotent,
    ...(idempotent ? { maxInFlightRequests: 1 } : {}),
  })
  await producer.connect()
  const compression = args.codec === 'gzip' ? CompressionTypes.GZIP : CompressionTypes.None
  const offsets = []
  const chunk = args.chunk
  const errors = []
  const codes = {}
  try {
    for (let i = 0; i < records.length; i += chunk) {
      const part = records.slice(i, i + chunk)
      // Sequential sends: one Produce request in flight keeps the order deterministic.
      let meta
      try {
        meta = await producer.send({
          topic: args.topic,
          acks: -1,
          compression,
          messages: part.map(r => toMessage(r, args.partition)),
        })
      } catch (e) {
        // A broker error code is on the error itself, or on the cause a retrier wrapped.
        const err = e && e.type === undefined && e.cause ? e.cause : e
        if (!args['allow-errors'] || !err || err.code === undefined) throw e
        codes[err.code] = (codes[err.code] || 0) + part.length
        errors.push(`${err.name} ${err.type}: ${err.message}`)
        continue
      }
      const base = Number(meta[0].baseOffset)
      if (meta[0].errorCode) throw new Error(`produce error code ${meta[0].errorCode}`)
      for (let j = 0; j < part.length; j++) offsets.push(base + j)
    }
  } finally {
    await producer.disconnect()
  }
  if (args['allow-errors']) return { n: offsets.length, error_codes: codes, errors }
  for (let i = 1; i < offsets.length; i++) {
    if (offsets[i] !== offsets[i - 1] + 1) {
      throw new Error(`producer acks not consecutive: ${offsets[i - 1]}, ${offsets[i]}`)
    }
  }
  return { n: offsets.length, offsets: offsets.length ? [offsets[0], offsets[offsets.length - 1]] : [] }
}

function headersOut(headers) {
  const out = []
  for (const [name, value] of Object.entries(headers || {})) {
    if (Array.isArray(value)) for (const v of value) out.push([name, unb64(v)])
    else out.push([name, unb64(value)])
  }
  return out
}

async function consume(kafka, args) {
  const createCluster = Object.getOwnPropertySymbols(kafka).find(
    s => s.description === 'private:Kafka:createCluster'
  )
  if (!createCluster) throw new Error('kafkajs internals changed: no createCluster symbol')
  const cluster = kafka[createCluster]({ allowAutoTopicCreation: false, metadataMaxAge: 300000 })
  await cluster.connect()
  const lines = []
  let hwm = -1
  try {
    await cluster.addTargetTopic(args.topic)
    const leaders = cluster.findLeaderForPartitions(args.topic, [args.partition])
    const nodeId = Object.keys(leaders)[0]
    const broker = await cluster.findBroker({ nodeId })
    let offset = args.offset
    const deadline = Date.now() + args.timeout * 1000
    let emptyAfterCount = 0
    let lastChange = Date.now()
    // Stop at the deadline, or after --idle seconds without a new record.
    while (Date.now() < deadline && Date.now() - lastChange < args.idle * 1000) {
      const res = await broker.fetch({
        replicaId: -1,
        isolationLevel: 1,
        maxWaitTime: 300,
        minBytes: 1,
        maxBytes: 8 * 1024 * 1024,
        topics: [
          {
            topic: args.topic,
            partitions: [
              { partition: args.partition, fetchOffset: String(offset), maxBytes: 4 * 1024 * 1024 },
            ],
          },
        ],
      })
      let got = 0
      for (const t of res.responses) {
        for (const p of t.partitions) {
          if (p.errorCode) throw new Error(`fetch error code ${p.errorCode}`)
          hwm = Number(p.highWatermark)
          for (const m of p.messages) {
            if (m.isControlRecord) continue
            const o = Number(m.offset)
            if (o < offset) continue // a batch may start before the requested offset
            lines.push(
              JSON.stringify({
                k: unb64(m.key),
                v: unb64(m.value),
                h: headersOut(m.headers),
                ts: Number(m.timestamp),
                o,
              })
            )
            offset = o + 1
            got++
          }
        }
      }
      if (got > 0) lastChange = Date.now()
      if (lines.length >= args.count && got === 0 && ++emptyAfterCount >= 2) break
    }
  } finally {
    await cluster.disconnect()
  }
  fs.writeFileSync(args.outfile, lines.length ? lines.join('\n') + '\n' : '')
  return { n: lines.length, high_watermark: hwm }
}

// TLS and SASL options from the security tests' client-neutral spec (test_security.py):
// {"protocol", "mechanism", "user", "password", "ca", "cert", "key"}.
function security(spec) {
  if (!spec) return {}
  const out = {}
  if (spec.ca) {
    out.ssl = { ca: [fs.readFileSync(spec.ca)] }
    if (spec.cert) Object.assign(out.ssl, { cert: fs.readFileSync(spec.cert), key: fs.readFileSync(spec.key) })
  }
  if (spec.mechanism) {
    out.sasl = { mechanism: spec.mechanism.toLowerCase(), username: spec.user, password: spec.password }
  }
  return out
}

async function main() {
  const args = parseArgs(process.argv.slice(2))
  const kafka = new Kafka({
    clientId: 'hk-compat-kafkajs',
    brokers: [args.bootstrap],
    logLevel: logLevel.WARN,
    retry: { retries: 5 },
    ...security(args.spec ? JSON.parse(args.spec) : null),
  })
  let summary
  if (args.action === 'produce') summary = await produce(kafka, args)
  else if (args.action === 'consume') summary = await consume(kafka, args)
  else throw new Error(`unknown action ${args.action}`)
  process.stdout.write(JSON.stringify(summary) + '\n')
}

main().then(
  () => process.exit(0),
  err => {
    process.stderr.write(`kafkajs worker failed: ${err && err.stack ? err.stack : err}\n`)
    process.exit(1)
  }
)
