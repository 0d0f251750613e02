// Command etcd is etcd v3.7.3's server, built from the Go module proxy so the
// e2e suites run a real etcd process (see tools/build.sh).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
