// One kafkajs consumer-group member, for compat_tests/test_groups.py.
//
// node group_worker.js --bootstrap B --topic T --group G [--session-ms 6000]
//   [--heartbeat-ms 500] [--delay-ms 0] [--max-records N] [--stop-file F] [--timeout S]
//
// Same JSON-lines protocol as compat_tests/workers/groupclient.py: "assigned" on every
// group join, "rec" per record (then the offset+1 is committed before the next one),
// "closed" at the end (consumer.disconnect() leaves the group).
'use strict'

const fs = require('fs')
const { Kafka, logLevel } = require('kafkajs')

function parse (argv) {
  const out = { sessionMs: 6000, heartbeatMs: 500, delayMs: 0, maxRecords: null, stopFile: null, timeout: 120 }
  const names = { '--bootstrap': 'bootstrap', '--topic': 'topic', '--group': 'group', '--session-ms': 'sessionMs', '--heartbeat-ms': 'heartbeatMs', '--delay-ms': 'delayMs', '--max-records': 'maxRecords', '--stop-file': 'stopFile', '--timeout': 'timeout' }
  for (let i = 0; i < argv.length; i += 2) {
    const key = names[argv[i]]
    if (!key) throw new Error(`unknown argument ${argv[i]}`)
    const v = argv[i + 1]
    out[key] = ['bootstrap', 'topic', 'group', 'stopFile'].includes(key) ? v : Number(v)
  }
  return out
}

function emit (event) {
  process.stdout.write(JSON.stringify(event) + '\n')
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

async function main () {
  const args = parse(process.argv.slice(2))
  const kafka = new Kafka({ clientId: 'hk-group-worker', brokers: [args.bootstrap], logLevel: logLevel.ERROR })
  const consumer = kafka.consumer({ groupId: args.group, sessionTimeout: args.sessionMs, heartbeatInterval: args.heartbeatMs, rebalanceTimeout: 10000 })
  let n = 0
  const deadline = Date.now() + args.timeout * 1000
  const stopNow = () => (args.stopFile && fs.existsSync(args.stopFile)) || (args.maxRecords !== null && n >= args.maxRecords) || Date.now() > deadline

  consumer.on(consumer.events.GROUP_JOIN, (e) => {
    const parts = (e.payload.memberAssignment[args.topic] || []).slice().sort((a, b) => a - b)
    emit({ ev: 'assigned', parts, t: Date.now() / 1000 })
  })
  await consumer.connect()
  await consumer.subscribe({ topics: [args.topic], fromBeginning: true })
  let stopping = false
  let inflight = Promise.resolve()
  await consumer.run({
    autoCommit: false,
    eachMessage: async (payload) => {
      if (stopping) return
      // The stop below waits for this record's commit: a record reported as read is
      // one whose commit was at least sent before the consumer disconnects.
      inflight = handle(payload)
      await inflight
    }
  })
  async function handle ({ topic, partition, message }) {
    emit({ ev: 'rec', p: partition, o: Number(message.offset), v: message.value.toString() })
    await sleep(args.delayMs)
    n += 1
    try {
      await consumer.commitOffsets([{ topic, partition, offset: String(Number(message.offset) + 1) }])
    } catch (err) {
      // A rebalance took the partition: its next owner re-reads from the last commit.
      process.stderr.write(`commit failed: ${err.message}\n`)
    }
  }
  while (!stopNow()) await sleep(100)
  stopping = true
  await inflight
  await consumer.disconnect()
  emit({ ev: 'closed', n })
}

main().catch((err) => {
  process.stderr.write(String(err && err.stack ? err.stack : err) + '\n')
  process.exit(1)
})
