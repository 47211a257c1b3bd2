// kafkajs's admin client for hyperkafka's compatibility tests.
//
// `node admin.js create|list|describe|delete|configs|list-groups|describe-groups|offsets|list-offsets
// --bootstrap H:P [--topic T]... [--group G]... [--at TS]... [--partitions N] [--timeout S]` prints one JSON line in the shape the Go driver's
// `hkgo CLIENT admin OP` prints (see compat_tests/workers/pyadmin.py), so one test serves
// every admin client. Error codes are Kafka's, read from what kafkajs surfaces: its
// protocol errors carry `.code`; createTopics answers `false` for a topic that already
// exists (TOPIC_ALREADY_EXISTS, 36) instead of throwing. createTopics, deleteTopics and
// describeConfigs go one topic a call, since kafkajs answers (or throws) per call.
'use strict'

const { Kafka, AssignerProtocol, ConfigResourceTypes, logLevel } = require('kafkajs')

const TOPIC_ALREADY_EXISTS = 36

// DescribeConfigs config_source, as Kafka's ConfigEntry.ConfigSource names it.
const CONFIG_SOURCES = [
  'UNKNOWN',
  'DYNAMIC_TOPIC_CONFIG',
  'DYNAMIC_BROKER_CONFIG',
  'DYNAMIC_DEFAULT_BROKER_CONFIG',
  'STATIC_BROKER_CONFIG',
  'DEFAULT_CONFIG',
  'DYNAMIC_BROKER_LOGGER_CONFIG',
  'CLIENT_METRICS_CONFIG',
  'GROUP_CONFIG',
]

function parseArgs(argv) {
  const args = { op: argv[0], topics: [], groups: [], ats: [], partitions: 1, timeout: 30 }
  for (let i = 1; i < argv.length; i += 2) {
    const name = argv[i].replace(/^--/, '')
    if (name === 'topic') args.topics.push(argv[i + 1])
    else if (name === 'group') args.groups.push(argv[i + 1])
    else if (name === 'at') args.ats.push(Number(argv[i + 1]))
    else args[name] = argv[i + 1]
  }
  args.partitions = Number(args.partitions)
  args.timeout = Number(args.timeout)
  return args
}

// The Kafka error code of a kafkajs error: its own, or that of the error a retrier wrapped.
function codeOf(e) {
  for (let err = e; err; err = err.cause || (err.errors && err.errors[0])) {
    if (typeof err.code === 'number') return err.code
  }
  throw e
}

async function run(admin, args) {
  const timeout = args.timeout * 1000
  switch (args.op) {
    case 'create': {
      const out = {}
      // One call per topic: kafkajs answers one boolean for the whole call.
      for (const topic of args.topics) {
        try {
          const created = await admin.createTopics({
            topics: [{ topic, numPartitions: args.partitions, replicationFactor: 1 }],
            waitForLeaders: true,
            timeout,
          })
          out[topic] = { error_code: created ? 0 : TOPIC_ALREADY_EXISTS }
        } catch (e) {
          out[topic] = { error_code: codeOf(e) }
        }
      }
      return { topics: out }
    }
    case 'delete': {
      const out = {}
      for (const topic of args.topics) {
        try {
          await admin.deleteTopics({ topics: [topic], timeout })
          out[topic] = { error_code: 0 }
        } catch (e) {
          out[topic] = { error_code: codeOf(e) }
        }
      }
      return { topics: out }
    }
    case 'list':
      return { topics: (await admin.listTopics()).sort() }
    case 'describe': {
      const out = {}
      const meta = await admin.fetchTopicMetadata({ topics: args.topics })
      for (const t of meta.topics) {
        const parts = t.partitions
          .map(p => ({
            partition: p.partitionId,
            leader: p.leader,
            replicas: p.replicas,
            isr: p.isr,
            error_code: p.partitionErrorCode,
          }))
          .sort((a, b) => a.partition - b.partition)
        out[t.name] = { error_code: 0, partitions: parts }
      }
      return { topics: out }
    }
    case 'configs': {
      const out = {}
      // One call per topic: kafkajs throws for the whole call if one resource has an error.
      for (const name of args.topics) {
        let res
        try {
          res = await admin.describeConfigs({
            includeSynonyms: false,
            resources: [{ type: ConfigResourceTypes.TOPIC, name }],
          })
        } catch (e) {
          out[name] = { error_code: codeOf(e), configs: {} }
          continue
        }
        for (const r of res.resources) {
          const configs = {}
          for (const c of r.configEntries) {
            configs[c.configName] = {
              value: c.configValue,
              source: CONFIG_SOURCES[c.configSource] || String(c.configSource),
            }
          }
          out[r.resourceName] = { error_code: r.errorCode, configs }
        }
      }
      return { topics: out }
    }
    case 'list-groups': {
      const out = {}
      for (const g of (await admin.listGroups()).groups) out[g.groupId] = { protocol_type: g.protocolType }
      return { groups: out }
    }
    case 'describe-groups': {
      const out = {}
      for (const g of (await admin.describeGroups(args.groups)).groups) {
        const members = g.members.map(m => ({
          member_id: m.memberId,
          assigned: m.memberAssignment.length
            ? AssignerProtocol.MemberAssignment.decode(m.memberAssignment).assignment
            : {},
        }))
        out[g.groupId] = { error_code: g.errorCode, state: g.state, protocol_type: g.protocolType, members }
      }
      return { groups: out }
    }
    case 'list-offsets': {
      // Partition 0 of the topic: -1 the high watermark and -2 the log start
      // (fetchTopicOffsets), a timestamp the first offset at or after it
      // (fetchTopicOffsetsByTimestamp, which answers the high watermark when there is none).
      const topic = args.topics[0]
      const offsets = {}
      for (const at of args.ats) {
        if (at === -1 || at === -2) {
          const p = (await admin.fetchTopicOffsets(topic)).find(x => x.partition === 0)
          offsets[at] = Number(at === -1 ? p.high : p.low)
        } else {
          const p = (await admin.fetchTopicOffsetsByTimestamp(topic, at)).find(x => x.partition === 0)
          offsets[at] = Number(p.offset)
        }
      }
      return { offsets }
    }
    case 'offsets': {
      const offsets = {}
      for (const t of await admin.fetchOffsets({ groupId: args.groups[0], topics: args.topics })) {
        for (const p of t.partitions) offsets[p.partition] = Number(p.offset)
      }
      return { offsets }
    }
    default:
      throw new Error(`unknown op ${args.op}`)
  }
}

async function main() {
  const args = parseArgs(process.argv.slice(2))
  const kafka = new Kafka({
    clientId: 'hk-compat-kafkajs-admin',
    brokers: [args.bootstrap],
    logLevel: logLevel.NOTHING,
    retry: { retries: 3 },
  })
  const admin = kafka.admin()
  await admin.connect()
  let summary
  try {
    summary = await run(admin, args)
  } finally {
    await admin.disconnect()
  }
  process.stdout.write(JSON.stringify(summary) + '\n')
}

main().then(
  () => process.exit(0),
  err => {
    process.stderr.write(`kafkajs admin failed: ${err && err.stack ? err.stack : err}\n`)
    process.exit(1)
  }
)
